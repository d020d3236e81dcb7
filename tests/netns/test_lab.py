"""Labs of namespaces: hosts reach each other, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest
from live import ended, wait_for
from pyroute2 import netns
from typer.testing import CliRunner

from netem.lab import Lab, lab_namespaces, remove_namespaces
from testbed.cli import app

pytestmark = pytest.mark.netns


def test_hosts_reach_each_other_over_the_bridge(make_lab):
    lab = make_lab(3)
    result = lab.run(
        lab.hosts[0], ["ping", "-c", "2", "-i", "0.01", "-W", "2", lab.hosts[2].address]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(lab_namespaces(lab.prefix)) == {h.netns for h in lab.hosts} | {lab.switch}


def test_close_removes_every_namespace():
    with Lab(2) as lab:
        prefix = lab.prefix
        assert lab_namespaces(prefix)
    assert lab_namespaces(prefix) == []


def test_a_forked_copy_of_the_builder_does_not_tear_the_lab_down(make_lab):
    """pyroute2 forks helpers holding a copy of the caller's stack; if one unwinds (a signal),
    the lab's clean-up runs in the copy and must leave the builder's lab alone."""
    lab = make_lab(2)
    child = os.fork()
    if child == 0:
        try:
            lab.close()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert len(lab_namespaces(lab.prefix)) == 3, "a forked copy removed the builder's lab"
    ping = lab.run(lab.hosts[0], ["ping", "-c", "1", "-W", "2", lab.hosts[1].address])
    assert ping.returncode == 0, ping.stdout + ping.stderr


def test_clean_removes_a_killed_run_and_nothing_else(make_lab):
    live = make_lab(1)
    bystander = f"other-{live.prefix}"
    netns.create(bystander)
    killed_prefix = f"{live.prefix}k"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; from netem.lab import Lab; "
            f"lab = Lab(2, prefix={killed_prefix!r}); lab.start(); "
            "sleeper = lab.popen(lab.hosts[0], ['sleep', '600']); "
            "print(sleeper.pid, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sleeper_pid = int(owner.stdout.readline())
        owner.kill()  # SIGKILL: the lab's own clean-up never runs
        owner.wait(timeout=10)
        assert len(lab_namespaces(killed_prefix)) == 3

        result = CliRunner().invoke(app, ["clean"])

        assert result.exit_code == 0, result.output
        assert f"{killed_prefix}-sw" in result.output
        assert lab_namespaces(killed_prefix) == []
        wait_for("the process inside the lab to end", partial(ended, sleeper_pid), bool, 5.0,
                 every=0.01)
        assert len(lab_namespaces(live.prefix)) == 2, "a live lab was removed"
        assert bystander in netns.listnetns()
    finally:
        owner.kill()
        netns.remove(bystander)
        remove_namespaces(killed_prefix)


def test_mtu_applies_to_hosts_and_switch_ports(make_lab):
    lab = make_lab(1, mtu=9000)
    for ns, iface in ((lab.hosts[0].netns, "eth0"), (lab.switch, lab.hosts[0].switch_port)):
        shown = subprocess.run(
            ["ip", "-n", ns, "-o", "link", "show", iface],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert " mtu 9000 " in shown, shown
