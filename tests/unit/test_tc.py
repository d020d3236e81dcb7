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
    ],
)
def test_netem_tc_args(profile, args):
    assert netem_tc_args(profile) == args.split()


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
