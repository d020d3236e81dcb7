"""The compose tier: a Docker Engine (Debian's docker.io, started here when none runs, with its
state in a temporary directory that goes with it), the images (scripts/compose-images.sh), and
a check that a Compose project leaves no container or network behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from live import unless_ended, wait_for

from testbed.compose.engine import mounts_under

ROOT = Path(__file__).resolve().parents[2]
ENGINE_WAIT = 60.0  # seconds for dockerd to answer
PACKAGES = ("docker.io", "debootstrap")
FORWARDING = "/proc/sys/net/ipv4/ip_forward"


def _engine_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _install() -> None:
    missing = [p for p in PACKAGES if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True
    ).stdout != "install ok installed"]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                       check=True, env=env, capture_output=True)


BRIDGES = ("docker0", "docker_gwbridge")  # the default bridge; a swarm's containers' way out


def _leftovers_of_dockerd() -> None:
    """What a stopped dockerd leaves: its bridges, its iptables rules and chains (DOCKER*)."""
    for bridge in BRIDGES:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
    for table in ("nat", "filter"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True,
                               text=True).stdout.splitlines()
        for rule in rules:
            words = rule.split()
            if words[0] == "-A" and any("DOCKER" in w or w in BRIDGES for w in words[2:]):
                subprocess.run(["iptables", "-t", table, "-D", *words[1:]], capture_output=True)
        chains = [rule.split()[1] for rule in rules
                  if rule.startswith("-N ") and rule.split()[1].startswith("DOCKER")]
        for flag in ("-F", "-X"):
            for chain in chains:
                subprocess.run(["iptables", "-t", table, flag, chain], capture_output=True)


def _host_settings() -> tuple[str, str]:
    """What dockerd changes on the host: the FORWARD policy and IPv4 forwarding."""
    forward = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True,
                             text=True).stdout.split("\n")[0].split()
    policy = forward[2] if len(forward) == 3 and forward[0] == "-P" else "ACCEPT"
    return policy, Path(FORWARDING).read_text().strip()


def _restore_host_settings(settings: tuple[str, str]) -> None:
    policy, forwarding = settings
    subprocess.run(["iptables", "-P", "FORWARD", policy], capture_output=True)
    Path(FORWARDING).write_text(forwarding + "\n")


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    """A running Docker Engine with the testbed's images. One started here is stopped after
    the session, its state removed; one that was running is left as it was."""
    if os.geteuid() != 0:
        pytest.fail("the compose tier needs root (to start Docker Engine)")
    _install()
    process = state = None
    host = _host_settings()
    if not _engine_up():
        state = Path(tempfile.mkdtemp(prefix="testbed-dockerd-"))
        log = (state / "dockerd.log").open("w")
        process = subprocess.Popen(
            ["dockerd", "--data-root", str(state / "data"), "--exec-root", str(state / "exec"),
             "--pidfile", str(state / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def tail() -> str:
            return (state / "dockerd.log").read_text()[-2000:]

        try:  # dockerd offers nothing to wait on but its socket
            wait_for("dockerd to answer", unless_ended(
                _engine_up, process, lambda: f"dockerd exited: {tail()}"), bool, ENGINE_WAIT,
                every=0.2, log=tail)
        except AssertionError:
            process.kill()
            raise
    try:
        built = subprocess.run([str(ROOT / "scripts" / "compose-images.sh")], cwd=ROOT,
                               capture_output=True, text=True)
        assert built.returncode == 0, f"building the images failed:\n{built.stderr[-4000:]}"
        yield
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            _leftovers_of_dockerd()
            _restore_host_settings(host)
            for point in mounts_under(state):  # its default network namespace, after a swarm
                subprocess.run(["umount", point], capture_output=True)
            shutil.rmtree(state, ignore_errors=True)
