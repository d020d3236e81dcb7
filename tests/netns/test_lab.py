"""Labs of namespaces: hosts reach each other, and nothing is left behind."""

from __future__ import annotations

import subprocess

import pytest
from pyroute2 import netns
from typer.testing import CliRunner

from netem.lab import Lab, lab_namespaces
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


def test_clean_removes_a_killed_run_and_nothing_else():
    lab = Lab(2)
    lab.start()  # never closed: as if the run was killed
    bystander = f"other-{lab.prefix}"
    netns.create(bystander)
    sleeper = lab.popen(lab.hosts[0], ["sleep", "600"])
    try:
        result = CliRunner().invoke(app, ["clean"])
        assert result.exit_code == 0, result.output
        assert lab.switch in result.output
        assert lab_namespaces(lab.prefix) == []
        assert sleeper.wait(timeout=10) != 0  # killed with its namespace
        assert bystander in netns.listnetns()
    finally:
        sleeper.kill()
        netns.remove(bystander)


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
