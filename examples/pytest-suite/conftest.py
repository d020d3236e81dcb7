"""Fixtures of the example suite: the key-value server in host 1 of the test's shaped network,
and a load run from host 0 (the plugin's `netem_network`, shaped as each test's marker says)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

KVSTORE = str(Path(__file__).with_name("kvstore.py"))
PORT = 7000


@pytest.fixture
def kv_server(netem_network):
    """The server, started in host 1 and bound before the test begins; the network stops it
    when the test ends."""
    server = netem_network[1].popen([sys.executable, KVSTORE, "serve", "--port", str(PORT)],
                                    stdout=subprocess.PIPE)
    line = server.stdout.readline()  # "listening" once bound, "" if it died
    assert line.strip() == "listening", f"the server did not start (exit {server.poll()})"
    return netem_network[1]


@pytest.fixture
def run_load(netem_network, kv_server) -> Callable[..., dict]:
    """Run the client from host 0 against the server: what happened, as a dict."""

    def run(requests: int = 50, deadline: float = 5.0) -> dict:
        done = netem_network[0].run(
            [sys.executable, KVSTORE, "load", kv_server.address, "--port", str(PORT),
             "--requests", str(requests), "--deadline", str(deadline)],
            timeout=60 + requests * deadline)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run
