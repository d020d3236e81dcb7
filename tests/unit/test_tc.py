"""tc's spelling without a kernel: handles both ways, and netem's arguments in tc-netem(8) order
(that tc itself agrees is checked in the guest, tests/netem_kernel/test_netlink_roundtrip.py)."""

from __future__ import annotations

import pytest
from pyroute2.netlink.rtnl import TC_H_ROOT

from netem.profile import LinkProfile
from netem.tc import format_handle, netem_tc_args, tc_handle


@pytest.mark.parametrize(
    ("profile", "args"),
    [
        (LinkProfile(), "limit 1000"),
        (
            LinkProfile.parse(
                delay="20ms", jitter="5ms", delay_correlation="25%", distribution="normal",
                loss="1%", rate="10mbit",
            ),
            "limit 1000 delay 20ms 5ms 25% distribution normal loss random 1% rate 10mbit",
        ),
        (
            LinkProfile.parse(
                gilbert_elliott={"p": "1%", "r": "20%", "1-h": "70%", "1-k": "0.1%"}, limit=50
            ),
            "limit 50 loss gemodel 1% 20% 70% 0.1%",
        ),
        (
            LinkProfile.parse(delay="10ms", reorder="25%", reorder_correlation="50%", gap=5),
            "limit 1000 delay 10ms reorder 25% 50% gap 5",
        ),
        (
            # tc sends no correlations for a lone duplicate correlation: an explicit 0% loss
            # correlation makes it send them.
            LinkProfile.parse(corrupt="0.5%", duplicate="2%", duplicate_correlation="10%"),
            "limit 1000 loss random 0% 0% corrupt 0.5% duplicate 2% 10%",
        ),
        (
            LinkProfile.parse(delay="1.5s", jitter="333ns", distribution="pareto", rate="1gbit"),
            "limit 1000 delay 1500ms 333ns distribution pareto rate 1gbit",
        ),
        (
            LinkProfile.parse(delay="20.000001ms", rate="123456bit"),
            "limit 1000 delay 20000001ns rate 123456bit",
        ),
        (
            LinkProfile.parse(loss="5%", ecn=True, seed=18446744073709551615),
            "limit 1000 loss random 5% ecn seed 18446744073709551615",
        ),
        (
            # Overheads are positional: a cell size goes after a packet overhead, 0 or not.
            LinkProfile.parse(rate="10mbit", cell_size=48),
            "limit 1000 rate 10mbit 0 48",
        ),
        (
            LinkProfile.parse(rate="10mbit", packet_overhead=-4, cell_size=48, cell_overhead=5),
            "limit 1000 rate 10mbit -4 48 5",
        ),
        (
            LinkProfile.parse(slot={"min_delay": "1ms", "max_delay": "5ms", "max_packets": 10,
                                    "max_bytes": 15000}),
            "limit 1000 slot 1ms 5ms packets 10 bytes 15000",
        ),
        (
            LinkProfile.parse(slot={"distribution": "pareto", "delay": "4ms", "jitter": "1ms"}),
            "limit 1000 slot distribution pareto 4ms 1ms",
        ),
    ],
)
def test_netem_tc_args(profile, args):
    assert netem_tc_args(profile) == args.split()


def test_a_samples_table_is_named_by_its_files_stem(tmp_path):
    samples = tmp_path / "wifi-rtt.csv"
    samples.write_text("seq,ms\n1,10\n2,12\n3,30\n")
    measured = {"samples": str(samples), "column": "ms", "unit": "ms"}
    profile = LinkProfile.parse(delay="20ms", jitter="9ms", distribution=measured,
                                slot={"distribution": measured})
    args = "limit 1000 delay 20ms 9ms distribution wifi-rtt slot distribution wifi-rtt"
    assert netem_tc_args(profile) == [*args.split(), "17333333ns", "11015141ns"]


@pytest.mark.parametrize(
    ("text", "value"),
    [("root", TC_H_ROOT), ("1:", 0x10000), ("1:0", 0x10000), ("1:a", 0x1000A), (0x20003, 0x20003)],
)
def test_handles(text, value):
    assert tc_handle(text) == value


@pytest.mark.parametrize("text", ["1", "x:", "1:g", ""])
def test_bad_handles(text):
    with pytest.raises(ValueError, match="expected a handle"):
        tc_handle(text)


def test_format_handle():
    assert [format_handle(h) for h in (0x10000, 0x1000A, TC_H_ROOT)] == ["1:", "1:a", "root"]
