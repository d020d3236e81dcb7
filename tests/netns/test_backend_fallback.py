"""The shaping backend on the host kernel (no sch_netem): the fallback's nftables loss and htb
rate on real namespaces, read back, measured with probe trains, changed and removed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pyroute2 import IPRoute
from typer.testing import CliRunner

import netem.backend
from netem import ShapingError, UnsupportedByKernel, apply, change, clear, show
from netem.capabilities import netem_available
from netem.plan import LOSS_MODULUS, build_plan, render_commands
from netem.probe import compare, offered_load, probe
from netem.profile import LinkProfile
from testbed.cli import app

pytestmark = pytest.mark.netns
FAST = 0.0001  # the host keeps up with 10 000 probes/s


def run_in(netns: str, *argv: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, text=True
    ).stdout


def qdiscs(netns: str, device: str) -> list[str]:
    return run_in(netns, "tc", "qdisc", "show", "dev", device).splitlines()


def nft_tables(netns: str) -> str:
    return run_in(netns, "nft", "list", "tables")


def links(netns: str) -> list[str]:
    return [line.split()[0].split("@")[0] for line in run_in(netns, "ip", "-br", "link")
            .splitlines()]


def assert_unshaped(netns: str, iface: str) -> None:
    assert show(iface, netns=netns) == {}
    assert qdiscs(netns, iface) == ["qdisc noqueue 0: root refcnt 2 "]
    assert nft_tables(netns) == ""
    assert not any(name.startswith("ifb") for name in links(netns))


def checks(profile: LinkProfile, result) -> dict:
    return {check.quantity: check for check in compare(profile, result)}


def test_loss_and_rate_per_source_on_a_switch_port(make_lab):
    lab = make_lab(3)
    a, b, c = lab.hosts
    lossy = LinkProfile.parse(loss="20%", rate="100mbit")
    default = LinkProfile.parse(loss="5%", limit=200)
    applied = apply(c.switch_port, {a.address: lossy, None: default}, netns=lab.switch,
                    backend="fallback")
    assert (applied.backend, applied.direction, applied.device) == ("fallback", "egress", "p2")
    assert show(c.switch_port, netns=lab.switch) == {a.address: lossy, None: default}
    # The kernel holds what the plan says: a class at the rate, the limit in the fifo, the loss
    # on the exact numgen grid.
    classes = run_in(lab.switch, "tc", "class", "show", "dev", "p2")
    assert "class htb 1:2 root leaf 102: prio 0 rate 100Mbit ceil 100Mbit" in classes
    assert "pfifo 101: parent 1:1 limit 200p" in "\n".join(qdiscs(lab.switch, "p2"))
    rules = run_in(lab.switch, "nft", "list", "chain", "netdev", "netem_testbed", "egress_p2")
    assert f"ip saddr {a.address} numgen random mod {LOSS_MODULUS} < 200000000 drop" in rules

    from_a = probe(a.netns, c.netns, c.address, count=20_000, interval=FAST, rate_duration=1.0,
                   offered_rate=offered_load(lossy))
    found = checks(lossy, from_a)
    for quantity in ("loss", "loss burst mean", "rate"):
        assert found[quantity].passed, found[quantity]
    from_b = probe(b.netns, c.netns, c.address, count=20_000, interval=FAST)
    assert checks(default, from_b)["loss"].passed, checks(default, from_b)["loss"]

    clear(c.switch_port, netns=lab.switch)
    assert_unshaped(lab.switch, c.switch_port)
    clear(c.switch_port, netns=lab.switch)  # idempotent


def test_ingress_shapes_the_receivers_own_interface_through_an_ifb(make_lab):
    lab = make_lab(3)
    a, b, c = lab.hosts
    lossy = LinkProfile.parse(loss="10%")
    rules = {a.address: lossy, None: LinkProfile.parse(rate="50mbit")}
    applied = apply(c.iface, rules, netns=c.netns, direction="ingress", backend="fallback")
    assert applied.device == "ifb-eth0"
    assert show(c.iface, netns=c.netns) == rules
    assert "ifb-eth0" in links(c.netns)
    assert any("ingress ffff:" in line for line in qdiscs(c.netns, c.iface))
    assert "table ip netem_testbed" in nft_tables(c.netns)

    from_a = probe(a.netns, c.netns, c.address, count=20_000, interval=FAST)
    assert checks(lossy, from_a)["loss"].passed, checks(lossy, from_a)["loss"]
    from_b = probe(b.netns, c.netns, c.address, count=5000, interval=FAST)
    assert from_b.loss_ratio == 0

    clear(c.iface, netns=c.netns)
    assert_unshaped(c.netns, c.iface)


def test_change_updates_profiles_in_place_and_rebuilds_for_new_sources(make_lab):
    lab = make_lab(3)
    a, b, c = lab.hosts
    port = c.switch_port
    apply(port, {a.address: LinkProfile.parse(loss="20%")}, netns=lab.switch, backend="fallback")
    calmer = {a.address: LinkProfile.parse(rate="10mbit", limit=100),
              None: LinkProfile.parse(loss="1%")}
    changed = change(port, calmer, netns=lab.switch, backend="fallback")
    assert changed.in_place
    assert show(port, netns=lab.switch) == calmer
    more = {**calmer, b.address: LinkProfile.parse(loss="3%")}
    rebuilt = change(port, more, netns=lab.switch, backend="fallback")
    assert not rebuilt.in_place
    assert show(port, netns=lab.switch) == more
    # Losing the last loss removes the nft chain (and its table) in place.
    quiet = {a.address: LinkProfile(), b.address: LinkProfile(), None: LinkProfile()}
    assert change(port, quiet, netns=lab.switch, backend="fallback").in_place
    assert show(port, netns=lab.switch) == quiet
    assert nft_tables(lab.switch) == ""


def test_a_new_apply_replaces_what_was_there(make_lab):
    lab = make_lab(2)
    port = lab.hosts[1].switch_port
    apply(port, {lab.hosts[0].address: LinkProfile.parse(loss="5%")}, netns=lab.switch,
          backend="fallback")
    apply(port, LinkProfile.parse(rate="10mbit"), netns=lab.switch, backend="fallback")
    assert show(port, netns=lab.switch) == {None: LinkProfile.parse(rate="10mbit")}
    assert nft_tables(lab.switch) == ""


@pytest.mark.parametrize("direction", ["egress", "ingress"])
def test_rendered_commands_build_the_same_tree(make_lab, direction):
    """What --dry-run prints, run by a shell, is read back as the plan's rules."""
    lab = make_lab(2)
    a, c = lab.hosts
    iface, netns = (c.switch_port, lab.switch) if direction == "egress" else (c.iface, c.netns)
    plan = build_plan(
        iface,
        {a.address: LinkProfile.parse(loss="12.5%", rate="30mbit", limit=64),
         "198.18.0.0/30": LinkProfile.parse(rate="5mbit"), None: LinkProfile.parse(loss="1%")},
        direction=direction, backend="fallback",
    )
    for command in render_commands(plan, netns):
        subprocess.run(command, shell=True, check=True, capture_output=True)
    assert show(iface, netns=netns) == plan.profiles()
    clear(iface, netns=netns)
    assert_unshaped(netns, iface)


def test_unsupported_profile_raises_and_leaves_nothing_behind(make_lab):
    lab = make_lab(2)
    port = lab.hosts[1].switch_port
    wan = LinkProfile.parse(delay="40ms", jitter="8ms", loss="2%")
    with pytest.raises(UnsupportedByKernel, match=r"delay, jitter .*netem.sandbox run --"):
        apply(port, {lab.hosts[0].address: wan}, netns=lab.switch, backend="fallback")
    assert_unshaped(lab.switch, port)


def test_the_netem_backend_is_refused_where_the_kernel_has_none(make_lab):
    if netem_available():
        pytest.skip("this kernel has sch_netem")
    lab = make_lab(1)
    with pytest.raises(UnsupportedByKernel, match="sch_netem"):
        apply("p0", LinkProfile.parse(delay="1ms"), netns=lab.switch, backend="netem")
    assert_unshaped(lab.switch, "p0")
    assert apply("p0", LinkProfile.parse(loss="1%"), netns=lab.switch).backend == "fallback"


def test_a_step_that_fails_leaves_the_interface_unshaped(make_lab, monkeypatch):
    lab = make_lab(2)
    port = lab.hosts[1].switch_port

    def refuse(statements, netns):
        raise ShapingError("nft: refused for the test")

    monkeypatch.setattr(netem.backend, "nft_script", refuse)
    with pytest.raises(ShapingError, match="refused for the test"):
        apply(port, {lab.hosts[0].address: LinkProfile.parse(loss="10%", rate="5mbit")},
              netns=lab.switch, backend="fallback")
    monkeypatch.undo()
    assert_unshaped(lab.switch, port)


def test_missing_namespace_and_interface_are_named(make_lab):
    lab = make_lab(1)
    with pytest.raises(ShapingError, match="network namespace 'tb-missing-sw' does not exist"):
        show("p0", netns="tb-missing-sw")
    with pytest.raises(ShapingError, match="no interface 'p9'"):
        apply("p9", LinkProfile(), netns=lab.switch, backend="fallback")
    assert not Path("/run/netns/tb-missing-sw").exists()


def test_offloads_are_off_on_lab_veths_and_on_shaped_interfaces(make_lab):
    lab = make_lab(2)
    host = lab.hosts[0]

    def features(netns: str, iface: str) -> dict[str, str]:
        lines = run_in(netns, "ethtool", "-k", iface).splitlines()[1:]
        return dict(line.strip().split(": ")[:2] for line in lines)

    for netns, iface in ((lab.switch, host.switch_port), (host.netns, host.iface)):
        found = features(netns, iface)
        for name in ("tcp-segmentation-offload", "generic-segmentation-offload",
                     "generic-receive-offload", "tx-udp-segmentation"):
            assert found[name].startswith("off"), (iface, name, found[name])
    with IPRoute(netns=host.netns) as ipr:  # a fresh device has them on; apply turns them off
        ipr.link("add", ifname="v0", kind="veth", peer={"ifname": "v1"})
    assert features(host.netns, "v0")["generic-segmentation-offload"] == "on"
    applied = apply("v0", LinkProfile.parse(loss="1%"), netns=host.netns, backend="fallback")
    assert set(applied.offloads_disabled) >= {"tso", "gso", "gro", "uso"}
    assert features(host.netns, "v0")["generic-segmentation-offload"] == "off"


def test_shape_command_cycle(make_lab):
    lab = make_lab(2)
    source = lab.hosts[0].address
    runner = CliRunner()
    base = ["shape", "p1", "--netns", lab.switch, "--backend", "fallback"]
    result = runner.invoke(app, [*base, "--loss", "5%"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [*base, "--from", source, "--loss", "20%", "--rate", "10mbit",
                                 "--json"])
    assert result.exit_code == 0, result.output
    applied = json.loads(result.output)
    assert applied["backend"] == "fallback" and not applied["in_place"]
    assert "gso" in applied["offloads_disabled"]
    expected = {source: LinkProfile.parse(loss="20%", rate="10mbit"),
                None: LinkProfile.parse(loss="5%")}
    assert show("p1", netns=lab.switch) == expected
    result = runner.invoke(app, ["shape", "p1", "--netns", lab.switch, "--show", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)["rules"]
    assert {r["from"]: LinkProfile.parse(r["profile"]) for r in listed} == expected
    result = runner.invoke(app, [*base, "--from", source, "--loss", "25%"])  # same tree
    assert result.exit_code == 0, result.output
    assert "changed in place" in result.output
    assert show("p1", netns=lab.switch)[source] == LinkProfile.parse(loss="25%")
    result = runner.invoke(app, ["shape", "p1", "--netns", lab.switch, "--clear"])
    assert result.exit_code == 0, result.output
    assert_unshaped(lab.switch, "p1")
    result = runner.invoke(app, ["shape", "p1", "--netns", lab.switch, "--show"])
    assert "p1: not shaped" in result.output


def test_shape_command_errors(make_lab):
    lab = make_lab(1)
    runner = CliRunner()
    result = runner.invoke(app, ["shape", "p0", "--netns", lab.switch, "--backend", "fallback",
                                 "--delay", "5ms"])
    assert result.exit_code == 2 and "sch_netem" in result.output
    result = runner.invoke(app, ["shape", "p7", "--netns", lab.switch, "--loss", "1%"])
    assert result.exit_code == 1 and "no interface 'p7'" in result.output
    assert_unshaped(lab.switch, "p0")


def test_dry_run_needs_no_root(tmp_path):
    """Run as `nobody`: the commands come out, nothing is probed or touched."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    result = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         str(Path(sys.executable).with_name("testbed")), "shape", "eth0", "--direction", "ingress",
         "--loss", "1%", "--delay", "10ms", "--dry-run"],
        capture_output=True, text=True, cwd=Path(__file__).parents[2],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "tc qdisc add dev ifb-eth0 parent 1:1 handle 101: netem limit 1000 delay 10ms loss " \
        "random 1%" in result.stdout
    assert "not root" in result.stderr
