"""`netem.session.Session` on the host kernel (the fallback: htb classes, nft loss): many ports
of one switch shaped at once, every change read back from the kernel equal to what was asked,
the shared nft table there exactly while some port loses packets, and a change in place (the
class keeps its counters) unless a port's sources change (rebuilt, counters from zero)."""

from __future__ import annotations

import json
import subprocess

import pytest

import netem
from netem.lab import Lab
from netem.plan import NFT_TABLE
from netem.profile import LinkProfile
from netem.session import Session

pytestmark = pytest.mark.netns


def loss(value: str) -> LinkProfile:
    return LinkProfile.parse(loss=value)


def nft_table(lab: Lab) -> bool:
    listing = subprocess.run(["ip", "netns", "exec", lab.switch, "nft", "-j", "list", "tables"],
                             capture_output=True, text=True, check=True).stdout
    return any(item.get("table", {}).get("name") == NFT_TABLE
               for item in json.loads(listing)["nftables"])


def class_bytes(lab: Lab, port: str, classid: str) -> int:
    """Bytes the htb class has sent (`tc -s`): a rebuilt class starts from zero."""
    text = subprocess.run(["ip", "netns", "exec", lab.switch, "tc", "-s", "class", "show", "dev",
                           port, "classid", classid], capture_output=True, text=True,
                          check=True).stdout
    words = text.split()
    return int(words[words.index("Sent") + 1])


def ping(lab: Lab, src: int, dst: int, count: int = 20, size: int = 56) -> None:
    lab.run(lab.hosts[src], ["ping", "-c", str(count), "-i", "0.01", "-q", "-W", "1",
                             "-s", str(size), lab.hosts[dst].address])


def test_many_ports_change_as_asked_and_the_nft_table_lives_while_some_port_loses(make_lab):
    lab = make_lab(4)
    session = Session(lab.switch, backend="fallback", offloads=False)
    a, b = lab.hosts[0].address, lab.hosts[1].address
    steps = [
        {f"p{d}": {None: loss("1%")} for d in range(4)},  # install: every port at once
        {"p0": {None: loss("5%")}, "p1": {None: loss("2%")}},  # loss only: one transaction
        {"p2": {a: loss("30%"), None: loss("1%")}},  # a new source: rebuilt
        {f"p{d}": {None: LinkProfile()} for d in (0, 1, 3)}  # losing their loss
        | {"p2": {a: LinkProfile(), None: LinkProfile()}},
        {"p3": {b: LinkProfile.parse(rate="10mbit"), None: LinkProfile()}},  # rate, no loss
        {"p1": {None: loss("100%")}},  # a cut: the table comes back
    ]
    expected: dict[str, dict] = {}
    for rules in steps:
        session.shape(rules)
        expected.update(rules)
        for port, wanted in expected.items():
            assert netem.show(port, netns=lab.switch) == wanted, port
            assert session.installed(port).profiles() == wanted
        lossy = any(p.loss > 0 for wanted in expected.values() for p in wanted.values())
        assert nft_table(lab) == lossy


def test_a_change_in_place_keeps_the_class_and_a_new_source_rebuilds_it(make_lab):
    """The rebuilt class counts from zero; what it shows by the time it is read is what crossed
    since, which is not always nothing: the kernel's own IPv6 packets (neighbour discovery,
    MLD reports: ~100 bytes each) came through once (110 bytes). So the ping sends 20 x 1.4 kB
    first, and the rebuilt class must show less than half of that."""
    lab = make_lab(2)
    session = Session(lab.switch, backend="fallback", offloads=False)
    port = lab.hosts[1].switch_port
    session.shape({port: {None: LinkProfile.parse(rate="100mbit")}})
    ping(lab, 0, 1, size=1400)
    sent = class_bytes(lab, port, "1:1")
    assert sent >= 20 * 1400
    session.shape({port: {None: LinkProfile.parse(rate="50mbit", loss="1%")}})  # in place
    assert class_bytes(lab, port, "1:1") >= sent
    session.shape({port: {lab.hosts[0].address: LinkProfile.parse(rate="50mbit"),
                          None: LinkProfile.parse(rate="50mbit")}})  # a source of its own
    assert class_bytes(lab, port, "1:1") < sent / 2, "the class kept its counters: not rebuilt"
    assert netem.show(port, netns=lab.switch)[lab.hosts[0].address].rate == 50_000_000


def test_what_the_backend_cannot_do_is_refused_before_anything_changes(make_lab):
    lab = make_lab(2)
    session = Session(lab.switch, backend="fallback", offloads=False)
    session.shape({"p0": {None: loss("1%")}})
    with pytest.raises(netem.UnsupportedByKernel, match="delay"):
        session.shape({"p0": {None: LinkProfile.parse(delay="5ms")},
                       "p1": {None: loss("9%")}})
    assert netem.show("p0", netns=lab.switch) == {None: loss("1%")}
    assert session.installed("p1") is None
