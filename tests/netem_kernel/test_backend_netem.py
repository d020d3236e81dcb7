"""The shaping backend with netem leaves, on a kernel that has sch_netem (the UML guest here:
`testbed sandbox pytest -m netem_kernel tests/netem_kernel/test_backend_netem.py`)."""

from __future__ import annotations

import os
import subprocess

import pytest

from netem import GilbertElliott, LinkProfile, apply, change, clear, show
from netem.netlink import ANNOTATIONS
from netem.plan import build_plan, render_commands

pytestmark = pytest.mark.netem_kernel

WAN = LinkProfile.parse(delay="40ms", jitter="8ms", distribution="normal", loss="2%",
                        rate="100mbit")
BURSTY = LinkProfile(delay=0.005, gilbert_elliott=GilbertElliott(p=0.01, r=0.25, loss_bad=0.9))
MESSY = LinkProfile.parse(delay="10ms", reorder="25%", reorder_correlation="10%", gap=5,
                          duplicate="1%", corrupt="0.5%", limit=300)


def run_in(netns: str, *argv: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, text=True
    ).stdout


def test_apply_show_change_clear_with_netem_leaves(make_lab):
    lab = make_lab(3)
    a, b, c = lab.hosts
    rules = {a.address: WAN, b.address: BURSTY, None: MESSY}
    applied = apply(c.switch_port, rules, netns=lab.switch)
    assert (applied.backend, applied.direction, applied.device) == ("netem", "egress", "p2")
    assert show(c.switch_port, netns=lab.switch) == rules
    qdiscs = run_in(lab.switch, "tc", "qdisc", "show", "dev", "p2")
    for handle, parent in (("102:", "1:2"), ("103:", "1:3"), ("101:", "1:1")):
        assert f"qdisc netem {handle} parent {parent} " in qdiscs
    annotations = ANNOTATIONS / f"{lab.switch}%2Fp2.json"
    assert annotations.exists()  # where the normal distribution is remembered

    swapped = {a.address: MESSY, b.address: WAN, None: BURSTY}
    changed = change(c.switch_port, swapped, netns=lab.switch)
    assert changed.in_place
    assert show(c.switch_port, netns=lab.switch) == swapped
    assert show(c.switch_port, netns=lab.switch)[b.address].distribution == "normal"

    rebuilt = change(c.switch_port, {a.address: WAN}, netns=lab.switch)
    assert not rebuilt.in_place
    assert show(c.switch_port, netns=lab.switch) == {a.address: WAN, None: LinkProfile()}

    clear(c.switch_port, netns=lab.switch)
    assert show(c.switch_port, netns=lab.switch) == {}
    assert "netem" not in run_in(lab.switch, "tc", "qdisc", "show", "dev", "p2")
    assert not annotations.exists()


def test_pairwise_networks_round_trip(make_lab):
    lab = make_lab(2)
    rules = {
        "198.18.0.1": WAN,
        "198.18.0.0/28": LinkProfile.parse(loss="1%"),
        "10.0.0.0/8": LinkProfile.parse(rate="1gbit"),
        "198.18.0.16/28": BURSTY,
        None: LinkProfile.parse(delay="1ms"),
    }
    apply(lab.hosts[1].switch_port, rules, netns=lab.switch)
    assert show(lab.hosts[1].switch_port, netns=lab.switch) == rules
    filters = run_in(lab.switch, "tc", "filter", "show", "dev", "p1")
    assert "match c6120001/ffffffff at 12" in filters  # the /32 is tried first (pref 1)
    assert filters.index("pref 1 ") < filters.index("c6120001") < filters.index("pref 2 ")


def test_ingress_with_netem_on_the_ifb(make_lab):
    lab = make_lab(2)
    host = lab.hosts[1]
    rules = {lab.hosts[0].address: WAN, None: LinkProfile()}
    applied = apply(host.iface, rules, netns=host.netns, direction="ingress")
    assert applied.device == "ifb-eth0"
    assert show(host.iface, netns=host.netns) == rules
    assert "qdisc netem 102: parent 1:2" in run_in(host.netns, "tc", "qdisc", "show", "dev",
                                                   "ifb-eth0")
    clear(host.iface, netns=host.netns)
    assert show(host.iface, netns=host.netns) == {}
    assert "ifb-eth0" not in run_in(host.netns, "ip", "-br", "link")


def test_offloads_are_off_on_the_shaped_interface(make_lab):
    lab = make_lab(2)
    host = lab.hosts[1]
    subprocess.run(["ip", "netns", "exec", host.netns, "ethtool", "-K", "eth0", "gso", "on",
                    "tso", "on"], check=True, capture_output=True)
    applied = apply(host.iface, LinkProfile.parse(delay="1ms"), netns=host.netns,
                    direction="ingress")
    assert set(applied.offloads_disabled) >= {"tso", "gso", "gro"}
    features = run_in(host.netns, "ethtool", "-k", "eth0")
    assert "generic-segmentation-offload: off" in features
    assert "tcp-segmentation-offload: off" in features


def test_rendered_commands_build_the_same_tree(make_lab):
    """What --dry-run prints, run by a shell (tc's netem), is read back as the plan's rules;
    uniform delays only, since `tc` records no distribution for `show`, and times on tc's 64 ns
    grid (tc rounds to it where netlink is exact)."""
    lab = make_lab(3)
    rules = {lab.hosts[0].address: MESSY, "198.18.0.0/30": BURSTY,
             None: LinkProfile.parse(delay="1ms", jitter="2ms", loss="0.5%", rate="1gbit")}
    plan = build_plan(lab.hosts[2].switch_port, rules, backend="netem")
    for command in render_commands(plan, lab.switch):
        subprocess.run(command, shell=True, check=True, capture_output=True)
    assert show(lab.hosts[2].switch_port, netns=lab.switch) == rules


def test_the_netem_backend_needs_no_nftables(make_lab, tmp_path, monkeypatch):
    """A kernel with netem but without a usable nftables (nf_tables not loaded: `nft` cannot
    even list chains): shaping with netem, reading it back and clearing it never need nft."""
    fake = tmp_path / "nft"
    fake.write_text("#!/bin/sh\necho 'netlink: Error: cache initialization failed: Invalid "
                    "argument' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    lab = make_lab(2)
    a, b = lab.hosts
    profile = LinkProfile.parse(delay="30ms", loss="10%")
    apply(b.switch_port, {a.address: profile, None: LinkProfile()}, netns=lab.switch)
    assert show(b.switch_port, netns=lab.switch)[a.address] == profile
    change(b.switch_port, {a.address: LinkProfile.parse(delay="10ms"), None: LinkProfile()},
           netns=lab.switch)
    clear(b.switch_port, netns=lab.switch)
    assert show(b.switch_port, netns=lab.switch) == {}
