"""netem through netlink against a real kernel: what `add_netem` installs, `read_netem` reads
back equal; a change replaces every setting; `tc` sees what `netem_tc_args` describes.

Runs where the kernel has sch_netem (inside the UML guest here: `testbed sandbox pytest -m
netem_kernel tests/netem_kernel/test_netlink_roundtrip.py`). Each test gets fresh dummy
interfaces in one namespace shared by the module.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pyroute2 import NetNS

from netem import netlink
from netem.lab import Lab
from netem.netlink import add_netem, forget_annotations, read_netem
from netem.probe import probe
from netem.profile import LinkProfile
from netem.tc import netem_tc_args

pytestmark = pytest.mark.netem_kernel

GE = {"p": "1%", "r": "20%", "1-h": "70%", "1-k": "0.1%"}
EVERYTHING = LinkProfile.parse(
    delay="20ms",
    jitter="5ms",
    delay_correlation="25%",
    distribution="normal",
    loss="1%",
    loss_correlation="10%",
    duplicate="5%",
    duplicate_correlation="30%",
    corrupt="0.5%",
    corrupt_correlation="1%",
    reorder="10%",
    reorder_correlation="20%",
    gap=5,
    rate="10mbit",
    limit=5000,
)
PROFILES = {
    "perfect": LinkProfile(),
    "delay": LinkProfile.parse(delay="20ms"),
    "normal": LinkProfile.parse(
        delay="20ms", jitter="5ms", delay_correlation="25%", distribution="normal"
    ),
    "nanoseconds": LinkProfile.parse(delay="1.000000001s", jitter="333ns", distribution="pareto"),
    "paretonormal": LinkProfile.parse(
        delay="100ms", jitter="2.147483647s", distribution="paretonormal"
    ),
    "loss": LinkProfile.parse(loss="1%", loss_correlation="0.000000001"),
    "loss-all": LinkProfile.parse(loss="100%", duplicate="100%", corrupt="100%"),
    "gilbert-elliott": LinkProfile.parse(gilbert_elliott=GE),
    "gilbert-elliott-edges": LinkProfile.parse(
        gilbert_elliott={"p": 1, "r": 0, "1-h": 0, "1-k": 1}
    ),
    "duplicate": LinkProfile.parse(duplicate="5%", duplicate_correlation="30%"),
    "corrupt": LinkProfile.parse(corrupt="0.5%", corrupt_correlation="1%"),
    "reorder": LinkProfile.parse(delay="10ms", reorder="25%"),
    "reorder-gap": LinkProfile.parse(delay="10ms", reorder="25%", reorder_correlation="50%", gap=5),
    "rate": LinkProfile.parse(rate="10mbit", limit=50),
    "rate64": LinkProfile.parse(rate="40gbit", limit=2**32 - 1),
    "everything": EVERYTHING,
    "seed": LinkProfile.parse(loss="10%", seed=2**64 - 1),
    "ecn": LinkProfile.parse(loss="5%", ecn=True),
    "ecn-gilbert-elliott": LinkProfile.parse(gilbert_elliott=GE, ecn=True),
    "rate-overheads": LinkProfile.parse(
        rate="10mbit", packet_overhead=-4, cell_size=48, cell_overhead=5
    ),
    "slot": LinkProfile.parse(slot={"min_delay": "1ms", "max_delay": "5.000001ms"}),
    "slot-limits": LinkProfile.parse(
        slot={"min_delay": "2ms", "max_packets": 10, "max_bytes": 15000}
    ),
    "slot-distribution": LinkProfile.parse(
        slot={"distribution": "pareto", "delay": "4ms", "jitter": "1ms", "max_packets": 5}
    ),
    "slot-uniform": LinkProfile.parse(
        slot={"distribution": "uniform", "delay": "4ms", "jitter": "1ms"}
    ),
    "everything-new": LinkProfile.parse(
        delay="20ms",
        jitter="5ms",
        distribution="normal",
        loss="1%",
        ecn=True,
        rate="10mbit",
        packet_overhead=20,
        cell_size=100,
        slot={"distribution": "paretonormal", "delay": "3ms", "jitter": "500us",
              "max_bytes": 64000},
        seed=42,
    ),
}


@dataclass
class Link:
    """A dummy interface in the test namespace, and the annotation key for it."""

    ipr: NetNS
    netns: str
    name: str
    index: int

    @property
    def key(self) -> str:
        return f"{self.netns}/{self.name}"

    def add(self, profile: LinkProfile, **options) -> None:
        options.setdefault("parent", "root")
        options.setdefault("handle", "1:")
        add_netem(self.ipr, self.index, profile=profile, annotate=self.key, **options)

    def read(self, handle: str = "1:") -> LinkProfile:
        return read_netem(self.ipr, self.index, handle, annotate=self.key)

    def tc(self, *args: str) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, "tc", *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout


@pytest.fixture(scope="module")
def namespace() -> Iterator[tuple[str, NetNS]]:
    with Lab(1) as lab, NetNS(lab.hosts[0].netns) as ipr:
        yield lab.hosts[0].netns, ipr


@pytest.fixture
def make_link(namespace) -> Iterator:
    netns, ipr = namespace
    links: list[Link] = []

    def make() -> Link:
        name = f"d{secrets.token_hex(3)}"
        ipr.link("add", ifname=name, kind="dummy")
        (index,) = ipr.link_lookup(ifname=name)
        links.append(Link(ipr, netns, name, index))
        return links[-1]

    yield make
    for link in links:
        ipr.link("del", index=link.index)
        forget_annotations(link.key)


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES.keys())
def test_profile_round_trips(make_link, profile):
    link = make_link()
    link.add(profile)
    assert link.read() == profile


def test_netems_under_classes(make_link):
    link = make_link()
    link.tc("qdisc", "add", "dev", link.name, "root", "handle", "1:", "prio", "bands", "3")
    link.add(EVERYTHING, parent="1:2", handle="20:")
    link.add(PROFILES["gilbert-elliott"], parent=0x10003, handle=0x300000)
    assert link.read("20:") == EVERYTHING
    assert link.read("30:") == PROFILES["gilbert-elliott"]
    with pytest.raises(ValueError, match=r"qdisc 1: on interface \d+ is prio, not netem"):
        link.read("1:")


def test_change_replaces_every_setting(make_link):
    link = make_link()
    link.add(EVERYTHING)
    for name in ("gilbert-elliott", "nanoseconds", "rate64", "perfect"):
        link.add(PROFILES[name], command="change")
        assert link.read() == PROFILES[name]
    link.add(EVERYTHING, command="replace", parent="root", handle="1:")
    assert link.read() == EVERYTHING


def test_change_replaces_the_new_settings(make_link):
    """ecn, rate overheads, slots and a seed come and go with a change like every setting."""
    link = make_link()
    link.add(PROFILES["slot"])
    # Never from a slot distribution to min/max slots: netem keeps the slot table (docs/netlink.md)
    for name in ("perfect", "slot-limits", "everything-new", "slot-distribution", "seed", "ecn"):
        link.add(PROFILES[name], command="change")
        assert link.read() == PROFILES[name]


def test_measured_distributions_round_trip(make_link, tmp_path):
    """Tables made from samples go with the qdisc; the record of their files and digests reads
    them back."""
    wifi, lte = tmp_path / "wifi.txt", tmp_path / "lte.csv"
    wifi.write_text("# ms\n2.1\n2.3\n9.8\n2.2\n2.4\n15.0\n2.2\n")
    lte.write_text("seq,delay_ms\n1,31\n2,35\n3,30\n4,52\n5,33\n")
    measured = LinkProfile.parse(
        distribution={"samples": str(wifi), "unit": "ms"},
        slot={"distribution": {"samples": str(lte), "column": "delay_ms", "unit": "us"}},
        seed=3,
    )
    other = LinkProfile.parse(delay="10ms", jitter="1ms",
                              distribution={"samples": str(lte), "column": "delay_ms",
                                            "unit": "ms"})
    link = make_link()
    link.add(measured)
    assert link.read() == measured
    link.add(other, command="change")
    assert link.read() == other


def test_replace_creates_then_changes(make_link):
    link = make_link()
    link.add(PROFILES["reorder-gap"], command="replace")
    link.add(PROFILES["loss"], command="replace")
    assert link.read() == PROFILES["loss"]
    assert link.tc("qdisc", "show", "dev", link.name).count("qdisc netem") == 1


def test_change_to_uniform_drops_the_old_table():
    """netem keeps the table of an earlier normal distribution unless the change brings one:
    uniform delays never go below delay - jitter, normal ones go below one time in six."""
    with Lab(2) as lab, NetNS(lab.switch) as switch:
        (port,) = switch.link_lookup(ifname=lab.hosts[1].switch_port)
        normal = LinkProfile.parse(delay="10ms", jitter="5ms", distribution="normal")
        add_netem(switch, port, "root", "1:", normal)
        before = probe(lab.hosts[0].netns, lab.hosts[1].netns, lab.hosts[1].address, count=300)
        uniform = normal.model_copy(update={"distribution": "uniform"})
        add_netem(switch, port, "root", "1:", uniform, command="change")
        after = probe(lab.hosts[0].netns, lab.hosts[1].netns, lab.hosts[1].address, count=300)
    assert before.delay_min < 0.005 <= after.delay_min


@pytest.mark.parametrize(
    "profile",
    [
        EVERYTHING,  # times in whole milliseconds: tc before iproute2 6.9 counts 64 ns ticks
        LinkProfile.parse(
            delay="10ms", gilbert_elliott=GE, duplicate="5%", duplicate_correlation="30%"
        ),
        # iproute2 6.1 knows no `seed`: the rest of the new settings
        LinkProfile.parse(
            loss="5%", ecn=True, rate="10mbit", packet_overhead=-4, cell_size=48,
            cell_overhead=5, slot={"min_delay": "1ms", "max_delay": "5ms", "max_packets": 10,
                                   "max_bytes": 15000},
        ),
    ],
    ids=["everything", "gilbert-elliott", "ecn-overheads-slot"],
)
def test_tc_agrees_with_netem_tc_args(make_link, profile):
    ours, theirs = make_link(), make_link()
    ours.add(profile)
    theirs.tc(
        "qdisc", "add", "dev", theirs.name, "root", "handle", "1:", "netem", *netem_tc_args(profile)
    )

    def shown(link: Link) -> dict:
        return json.loads(link.tc("-j", "qdisc", "show", "dev", link.name))[0]["options"]

    assert shown(ours) == shown(theirs)
    keywords = {"limit", "delay", "loss", "corrupt", "duplicate", "reorder", "gap", "rate"}
    text = ours.tc("qdisc", "show", "dev", ours.name).split()
    assert keywords & set(netem_tc_args(profile)) <= set(text)
    # tc's qdisc reads back as the profile, but for the table's name that no dump carries
    assert read_netem(theirs.ipr, theirs.index, "1:") == profile.model_copy(
        update={"distribution": "uniform"}
    )


def test_forget_annotations_removes_the_record(make_link):
    link = make_link()
    link.add(EVERYTHING)
    record = netlink.ANNOTATIONS / f"{link.netns}%2F{link.name}.json"
    assert json.loads(record.read_text()) == {"1:": "normal"}
    forget_annotations(link.key)
    assert not record.exists()
    assert link.read() == EVERYTHING.model_copy(update={"distribution": "uniform"})


def test_read_errors(make_link):
    link = make_link()
    with pytest.raises(LookupError, match="no qdisc 1: on interface"):
        link.read()
    link.tc(
        "qdisc", "add", "dev", link.name, "root", "handle", "1:", "netem", "loss", "state", "1%"
    )
    with pytest.raises(ValueError, match="netem uses 4-state loss"):
        link.read()
