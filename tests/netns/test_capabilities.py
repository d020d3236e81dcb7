"""Capability detection agrees with the kernel, checked independently with iproute2 and nft,
and leaves nothing behind. Nothing here assumes which kernel this is, except where it says
what a kernel without netem must still offer for the fallback."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pyroute2 import netns
from typer.testing import CliRunner

from netem.capabilities import (
    CONSEQUENCES,
    NETNS_PREFIX,
    Capabilities,
    detect,
    netem_available,
    probe_kernel,
    remove_orphan_probes,
)
from testbed.cli import app

pytestmark = pytest.mark.netns


@pytest.fixture
def scratch() -> Iterator[str]:
    """A namespace with a veth pair va<->vb and an ifb vi, made with iproute2 (not pyroute2)."""
    name = f"tbtest-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        ip = ["ip", "-n", name, "link"]
        subprocess.run([*ip, "add", "name", "va", "type", "veth", "peer", "name", "vb"], check=True)
        subprocess.run([*ip, "add", "name", "vi", "type", "ifb"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def tc(namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("feature", "command"),
    [
        ("netem", "qdisc add dev va root netem delay 1ms"),
        ("htb", "qdisc add dev vb root handle 1: htb"),
        ("tbf", "qdisc add dev vi root tbf rate 1mbit burst 32k latency 50ms"),
        ("ingress", "qdisc add dev va ingress"),
    ],
)
def test_qdisc_answers_match_what_tc_can_do(scratch, feature, command):
    result = tc(scratch, *command.split())
    assert getattr(detect(), feature) == (result.returncode == 0), result.stderr


def test_when_netem_is_missing_adding_it_really_fails(scratch):
    result = tc(scratch, "qdisc", "add", "dev", "va", "root", "netem", "loss", "5%")
    if netem_available():
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert "unknown" in result.stderr.lower()
        assert "does not know this kind" in detect().details["netem"]


def test_a_kernel_without_netem_still_has_the_fallback_pieces():
    if netem_available():
        pytest.skip("this kernel has netem; the fallback's pieces are not required")
    capabilities = detect()
    for feature in ("veth", "ifb", "htb", "tbf", "u32", "ingress", "mirred"):
        assert getattr(capabilities, feature), (feature, capabilities.details.get(feature))


def test_nftables_answer_matches_nft(scratch):
    if shutil.which("nft") is None:
        assert not detect().nftables
        return
    result = subprocess.run(
        ["ip", "netns", "exec", scratch, "nft", "-f", "-"],
        input="table inet t { chain c { type filter hook input priority 0; }; }\n"
        "add rule inet t c numgen random mod 100 < 10 drop\n",
        capture_output=True,
        text=True,
    )
    assert detect().numgen == (result.returncode == 0), result.stderr


def test_probing_leaves_no_namespace_behind():
    found, _ = probe_kernel(refresh=True)
    assert found["netns"]
    assert [n for n in netns.listnetns() if n.startswith(NETNS_PREFIX)] == []


def test_clean_removes_only_probes_whose_process_is_gone():
    # 999999999 is above any pid_max, so no process can own the first one.
    orphan, live = f"{NETNS_PREFIX}999999999-dead", f"{NETNS_PREFIX}{os.getpid()}-live"
    for name in (orphan, live):
        netns.create(name)
    try:
        assert remove_orphan_probes() == [orphan]
        assert live in netns.listnetns() and orphan not in netns.listnetns()
    finally:
        for name in (orphan, live):
            with contextlib.suppress(FileNotFoundError):
                netns.remove(name)


def test_results_are_cached_per_process():
    assert detect() is detect()


def test_every_capability_has_its_consequences():
    names = [name for name, _ in detect().items()]
    assert set(names) == set(CONSEQUENCES)
    assert names[0] == "root"
    assert isinstance(detect(), Capabilities)


def test_doctor_reports_every_capability_and_what_follows():
    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    capabilities = detect()
    rows = {
        cells[1].strip(): cells
        for cells in (line.split("│") for line in result.output.splitlines())
        if len(cells) == 6 and cells[1].strip()
    }
    for name, available in capabilities.items():
        assert rows[name][2].strip() == ("yes" if available else "no")
        assert rows[name][4].strip().startswith(CONSEQUENCES[name][0 if available else 1][:40])


def test_without_root_nothing_is_tried():
    code = (
        "from netem.capabilities import detect\n"
        "c = detect()\n"
        "print(c.root, c.netns, c.netem, c.details['netem'])\n"
    )
    unprivileged = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    result = subprocess.run(
        [*unprivileged, sys.executable, "-c", code], capture_output=True, text=True, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False False False not tried: needs root\n"


def test_where_no_namespace_can_be_made_the_features_are_tried_in_this_one(scratch: str):
    """A Compose worker has CAP_NET_ADMIN but not CAP_SYS_ADMIN: it cannot make a namespace,
    yet it can shape its own. Without CAP_SYS_ADMIN, inside a namespace of its own, the probe
    finds what the namespace path finds, and leaves no interface or nft table behind."""
    script = ("import json; from netem.capabilities import probe_kernel; "
              "print(json.dumps(probe_kernel()))")
    result = subprocess.run(
        ["ip", "netns", "exec", scratch, "setpriv", "--inh-caps=-sys_admin",
         "--bounding-set=-sys_admin", "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found, details = json.loads(result.stdout)
    assert not found["netns"] and "tried in this one" in details["netns"], details
    expected, _ = probe_kernel()
    assert {k: v for k, v in found.items() if k != "netns"} == {
        k: v for k, v in expected.items() if k != "netns"}, (found, details)
    links = subprocess.run(["ip", "-n", scratch, "-o", "link"], capture_output=True,
                           text=True, check=True).stdout
    assert "tbcap" not in links, links
    tables = subprocess.run(["ip", "netns", "exec", scratch, "nft", "list", "tables"],
                            capture_output=True, text=True).stdout
    assert "tbcap" not in tables, tables
