"""Shaping plans and the commands they render to: no root, no kernel."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from netem.plan import (
    LOSS_MODULUS,
    UNLIMITED,
    FifoLeaf,
    HtbClass,
    Ifb,
    IngressQdisc,
    NetemLeaf,
    NftLoss,
    Offloads,
    Redirect,
    RootHtb,
    SourceFilter,
    UnsupportedByKernel,
    build_plan,
    ifb_name,
    nft_chain,
    render_commands,
)
from netem.profile import LinkProfile, ProfileError
from testbed.cli import app

WAN = LinkProfile.parse(delay="40ms", jitter="8ms", distribution="normal", loss="2%",
                        rate="100mbit")
LOSSY = LinkProfile.parse(loss="20%", rate="10mbit")


def test_one_profile_is_one_rule_for_everyone():
    plan = build_plan("p1", WAN)
    assert plan.profiles() == {None: WAN}
    assert render_commands(plan, "tb1234-sw") == [
        "ip netns exec tb1234-sw ethtool -K p1 tso off gso off tx-udp-segmentation off gro off "
        "lro off",
        "ip netns exec tb1234-sw tc qdisc replace dev p1 root handle 1: htb default 1",
        "ip netns exec tb1234-sw tc class add dev p1 parent 1: classid 1:1 htb rate 8000gbit "
        "ceil 8000gbit quantum 1514",
        "ip netns exec tb1234-sw tc qdisc add dev p1 parent 1:1 handle 101: netem limit 1000 "
        "delay 40ms 8ms distribution normal loss random 2% rate 100mbit",
    ]


def test_pairwise_rules_most_specific_source_first_default_last():
    plan = build_plan(
        "p2",
        {"198.18.0.0/24": LOSSY, None: LinkProfile(), "198.18.0.1/32": WAN, "10.0.0.0/8": WAN},
    )
    assert [(rule.source, rule.minor) for rule in plan.rules] == [
        ("198.18.0.1", 2), ("198.18.0.0/24", 3), ("10.0.0.0/8", 4), (None, 1),
    ]
    filters = [step for step in plan.steps if isinstance(step, SourceFilter)]
    assert [(f.prio, f.source, f.classid) for f in filters] == [
        (1, "198.18.0.1", 0x10002), (2, "198.18.0.0/24", 0x10003), (3, "10.0.0.0/8", 0x10004),
    ]
    leaves = [step for step in plan.steps if isinstance(step, NetemLeaf)]
    assert [(leaf.parent, leaf.handle, leaf.profile) for leaf in leaves] == [
        (0x10002, 0x1020000, WAN), (0x10003, 0x1030000, LOSSY), (0x10004, 0x1040000, WAN),
        (0x10001, 0x1010000, LinkProfile()),
    ]
    assert filters[1].commands() == [
        "tc filter add dev p2 parent 1: protocol ip prio 2 u32 match ip src 198.18.0.0/24 "
        "flowid 1:3"
    ]
    # Keys come back normalised, and a missing default is a perfect link.
    assert build_plan("p2", {"198.18.0.7/32": WAN}).profiles() == {
        "198.18.0.7": WAN, None: LinkProfile()
    }


def test_ipv6_sources_are_matched_in_the_ipv6_header():
    plan = build_plan("p1", {"fd00:7e57::/64": LOSSY, "fd00:7e57::1": WAN})
    filters = [step for step in plan.steps if isinstance(step, SourceFilter)]
    assert [step.commands()[0] for step in filters] == [
        "tc filter add dev p1 parent 1: protocol ipv6 prio 1 u32 match ip6 src "
        "fd00:7e57::1/128 flowid 1:2",
        "tc filter add dev p1 parent 1: protocol ipv6 prio 2 u32 match ip6 src fd00:7e57::/64 "
        "flowid 1:3",
    ]
    assert plan.profiles() == {"fd00:7e57::1": WAN, "fd00:7e57::/64": LOSSY, None: LinkProfile()}


def test_a_senders_ipv4_and_ipv6_addresses_share_one_class():
    """One link, whatever the family: one class, one leaf (one rate, one queue), a filter per
    address; per family the most specific source is still tried first."""
    host = ("fd00:7e57::1", "198.18.0.1")  # in any order
    plan = build_plan("p2", {"198.18.0.0/24": LOSSY, host: WAN, "fd00:7e57::/64": LOSSY})
    assert [(rule.source, rule.minor) for rule in plan.rules] == [
        (("198.18.0.1", "fd00:7e57::1"), 2), ("198.18.0.0/24", 3), ("fd00:7e57::/64", 4),
        (None, 1),
    ]
    assert sum(isinstance(step, NetemLeaf) for step in plan.steps) == 4
    filters = [step for step in plan.steps if isinstance(step, SourceFilter)]
    assert [(f.prio, f.source, f.classid) for f in filters] == [
        (1, "198.18.0.1", 0x10002), (2, "198.18.0.0/24", 0x10003),
        (3, "fd00:7e57::1", 0x10002), (4, "fd00:7e57::/64", 0x10004),
    ]
    # `show` answers per address; `as_rules` gives the rules that build the same plan again.
    assert plan.profiles() == {"198.18.0.1": WAN, "fd00:7e57::1": WAN, "198.18.0.0/24": LOSSY,
                               "fd00:7e57::/64": LOSSY, None: LinkProfile()}
    assert build_plan("p2", plan.as_rules()) == plan
    assert plan.layout != build_plan("p2", {"198.18.0.1": WAN, "fd00:7e57::1": WAN,
                                            "198.18.0.0/24": LOSSY,
                                            "fd00:7e57::/64": LOSSY}).layout


def test_fallback_drops_ipv6_sources_by_their_ipv6_address():
    plan = build_plan("p1", {("198.18.0.1", "fd00:7e57::1"): LOSSY, "fd00:7e57::2": LinkProfile()},
                      backend="fallback")
    (nft,) = [step for step in plan.steps if isinstance(step, NftLoss)]
    where = "netdev netem_testbed egress_p1"
    assert nft.statements()[3:] == [
        f"add rule {where} ip saddr 198.18.0.1 numgen random mod 1000000000 < 200000000 drop",
        f"add rule {where} ip saddr 198.18.0.1 accept",
        f"add rule {where} ip6 saddr fd00:7e57::1 numgen random mod 1000000000 < 200000000 drop",
        f"add rule {where} ip6 saddr fd00:7e57::1 accept",
        f"add rule {where} ip6 saddr fd00:7e57::2 accept",
    ]


def test_fallback_ingress_refuses_ipv6_loss_it_cannot_see():
    """The ingress chain is nft family ip: an IPv6 source's loss would silently not happen."""
    with pytest.raises(UnsupportedByKernel, match="cannot drop IPv6 at ingress"):
        build_plan("eth0", {"fd00:7e57::1": LOSSY}, direction="ingress", backend="fallback")
    rate_only = build_plan("eth0", {"fd00:7e57::1": LinkProfile.parse(rate="10mbit")},
                           direction="ingress", backend="fallback")
    assert rate_only.profiles()["fd00:7e57::1"].rate == 10_000_000


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"198.18.0.1": WAN, "198.18.0.1/32": LOSSY}, "given twice"),
        ({"198.18.0.1/24": WAN}, "has host bits set"),
        ({"fd00:7e57::1/64": WAN}, "has host bits set"),
        ({("198.18.0.1", "fd00:7e57::1"): WAN, "fd00:7e57::1/128": LOSSY}, "given twice"),
        ({(): WAN}, "names no address"),
        ({"host-a": WAN}, "not an IPv4 address"),
    ],
)
def test_bad_sources_are_named(rules, message):
    with pytest.raises(ValueError, match=message):
        build_plan("p1", rules)


def test_rules_stay_within_the_handle_space():
    sources = {f"10.0.{n // 256}.{n % 256}": LOSSY for n in range(4096)}
    with pytest.raises(ValueError, match="at most 4095 sources, got 4096"):
        build_plan("p1", sources)
    sources.popitem()
    assert build_plan("p1", sources).rules[-2].leaf == (0x100 + 4096) << 16


@pytest.mark.parametrize("iface", ["", "a" * 16, "eth 0", 'e"th0', "a/b"])
def test_bad_interface_names(iface):
    with pytest.raises(ValueError, match="iface"):
        build_plan(iface, WAN)


def test_bad_direction_and_backend_are_named():
    with pytest.raises(ValueError, match="direction: expected one of egress, ingress"):
        build_plan("p1", WAN, direction="sideways")
    with pytest.raises(ValueError, match="backend: expected one of netem, fallback"):
        build_plan("p1", WAN, backend="tc")


def test_ingress_redirects_to_an_ifb_that_carries_the_tree():
    plan = build_plan("eth0", {"198.18.0.1": WAN}, direction="ingress")
    assert plan.device == "ifb-eth0"
    kinds = [type(step) for step in plan.steps]
    # The tree is complete before the redirect sends traffic into it.
    assert kinds == [Offloads, Ifb, RootHtb, HtbClass, NetemLeaf, HtbClass, NetemLeaf,
                     SourceFilter, IngressQdisc, Redirect]
    assert plan.steps[0] == Offloads("eth0")
    assert all(step.device == "ifb-eth0" for step in plan.steps[2:8])
    assert render_commands(plan)[-2:] == [
        "tc qdisc add dev eth0 handle ffff: ingress",
        "tc filter add dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 action mirred "
        "egress redirect dev ifb-eth0",
    ]


def test_ifb_names_fit_and_stay_distinct():
    assert ifb_name("eth0") == "ifb-eth0"
    long_a, long_b = ifb_name("enp0s31f6-vlan1"), ifb_name("enp0s31f6-vlan2")
    assert len(long_a) == len(long_b) == 15 and long_a != long_b
    assert ifb_name("enp0s31f6-vlan1") == long_a  # deterministic: clear finds it again


def test_nft_chain_names_are_identifiers_and_distinct():
    assert nft_chain("egress", "p1") == "egress_p1"
    names = {nft_chain("ingress", name) for name in ("a-b", "a_b", "a.b", "ab")}
    assert len(names) == 4
    assert all(re.fullmatch(r"[a-z]+_[A-Za-z0-9_]+", name) for name in names)


def test_fallback_meters_rate_with_htb_and_keeps_the_limit_in_a_fifo():
    plan = build_plan(
        "p1",
        {"198.18.0.1": LOSSY, None: LinkProfile.parse(limit=50)},
        backend="fallback",
    )
    classes = [step for step in plan.steps if isinstance(step, HtbClass)]
    assert [(c.classid, c.rate) for c in classes] == [(0x10002, 10_000_000), (0x10001, UNLIMITED)]
    fifos = [step for step in plan.steps if isinstance(step, FifoLeaf)]
    assert [(f.handle, f.limit) for f in fifos] == [(0x1020000, 1000), (0x1010000, 50)]
    assert not any(isinstance(step, NetemLeaf) for step in plan.steps)
    assert classes[0].commands() == [
        "tc class add dev p1 parent 1: classid 1:2 htb rate 10mbit ceil 10mbit quantum 1514"
    ]


def test_fallback_egress_loss_is_an_nft_netdev_egress_chain():
    plan = build_plan(
        "p1",
        {"198.18.0.1": LOSSY, "198.18.0.2": LinkProfile(), None: LinkProfile.parse(loss="5%")},
        backend="fallback",
    )
    (nft,) = [step for step in plan.steps if isinstance(step, NftLoss)]
    where = "netdev netem_testbed egress_p1"
    assert nft.statements() == [
        "add table netdev netem_testbed",
        f'add chain {where} {{ type filter hook egress device "p1" priority 0; policy accept; }}',
        f"flush chain {where}",
        f"add rule {where} ip saddr 198.18.0.1 numgen random mod 1000000000 < 200000000 drop",
        f"add rule {where} ip saddr 198.18.0.1 accept",
        f"add rule {where} ip saddr 198.18.0.2 accept",
        f"add rule {where} meta protocol ip numgen random mod 1000000000 < 50000000 drop",
    ]
    (command,) = nft.commands()
    assert command.startswith("nft 'add table netdev netem_testbed; add chain")


def test_fallback_ingress_loss_drops_in_raw_prerouting_of_the_receiver():
    plan = build_plan("eth0", LinkProfile.parse(loss="10%"), direction="ingress",
                      backend="fallback")
    (nft,) = [step for step in plan.steps if isinstance(step, NftLoss)]
    assert nft.statements()[1:] == [
        "add chain ip netem_testbed ingress_eth0 { type filter hook prerouting priority raw; "
        "policy accept; }",
        "flush chain ip netem_testbed ingress_eth0",
        'add rule ip netem_testbed ingress_eth0 iifname "eth0" numgen random mod 1000000000 < '
        "100000000 drop",
    ]


def test_fallback_loss_is_exact_on_the_profile_grid():
    profile = LinkProfile(loss=0.123456789)
    (nft,) = [s for s in build_plan("p1", profile, backend="fallback").steps
              if isinstance(s, NftLoss)]
    cut = int(re.search(r"< (\d+) drop", nft.statements()[-1]).group(1))
    assert cut / LOSS_MODULUS == profile.loss


def test_fallback_drops_everything_with_a_plain_drop_at_100_percent():
    (nft,) = [s for s in build_plan("p1", {"198.18.0.1": LinkProfile(loss=1.0)},
                                    backend="fallback").steps if isinstance(s, NftLoss)]
    assert nft.statements()[-2].endswith("ip saddr 198.18.0.1 drop")
    assert "numgen" not in "; ".join(nft.statements())


def test_fallback_without_loss_needs_no_nft():
    plan = build_plan("p1", LinkProfile.parse(rate="1gbit"), backend="fallback")
    assert not any(isinstance(step, NftLoss) for step in plan.steps)


def test_fallback_refuses_what_only_netem_does_and_names_it():
    rules = {
        "198.18.0.1": LinkProfile.parse(delay="10ms", jitter="1ms", loss="1%"),
        None: LinkProfile.parse(duplicate="1%", duplicate_correlation="5%"),
    }
    with pytest.raises(UnsupportedByKernel) as caught:
        build_plan("p1", rules, backend="fallback")
    message = str(caught.value)
    assert "delay, jitter (from 198.18.0.1)" in message
    assert "duplicate, duplicate_correlation (everyone else)" in message
    assert "sch_netem" in message and "python -m netem.sandbox run --" in message
    assert "loss" not in message.split("(the fallback does")[0]
    assert isinstance(caught.value, ProfileError)
    for fields in ({"gilbert_elliott": {"p": "1%"}}, {"loss": "1%", "loss_correlation": "5%"},
                   {"delay": "1ms", "reorder": "5%"}, {"corrupt": "1%"}):
        with pytest.raises(UnsupportedByKernel, match=next(iter(fields))):
            build_plan("p1", LinkProfile.parse(fields), backend="fallback")


def test_fallback_rate_must_stay_below_the_unlimited_ceiling():
    with pytest.raises(ProfileError, match="rate"):
        build_plan("p1", LinkProfile(rate=UNLIMITED), backend="fallback")


def test_layout_ignores_profiles_but_not_sources():
    one = build_plan("p1", {"198.18.0.1": WAN, None: LinkProfile()})
    two = build_plan("p1", {"198.18.0.1": LOSSY, None: WAN})
    three = build_plan("p1", {"198.18.0.2": WAN})
    assert one.layout == two.layout != three.layout
    assert one.layout != build_plan("p1", {"198.18.0.1": WAN}, direction="ingress").layout
    assert two.layout != build_plan("p1", {"198.18.0.1": LOSSY, None: LinkProfile()},
                                    backend="fallback").layout


def test_fallback_takes_a_seed_it_cannot_use_and_refuses_the_new_netem_fields():
    seeded = build_plan("p1", LinkProfile.parse(loss="10%", seed=7), backend="fallback")
    plain = build_plan("p1", LinkProfile.parse(loss="10%"), backend="fallback")
    assert [s for s in seeded.steps if isinstance(s, NftLoss)] == (
        [s for s in plain.steps if isinstance(s, NftLoss)])  # numgen takes no seed
    for fields in ({"loss": "1%", "ecn": True}, {"slot": {"min_delay": "1ms"}},
                   {"rate": "1mbit", "packet_overhead": 20}, {"rate": "1mbit", "cell_size": 48}):
        with pytest.raises(UnsupportedByKernel, match=list(fields)[-1]):
            build_plan("p1", LinkProfile.parse(fields), backend="fallback")


def test_a_slot_distribution_coming_or_going_rebuilds_the_tree():
    """netem keeps a slot table once given, and then never takes min/max slots again."""
    shaped = LinkProfile.parse(slot={"distribution": "normal", "delay": "4ms", "jitter": "1ms"})
    fixed = LinkProfile.parse(slot={"min_delay": "1ms", "max_delay": "4ms"})
    reshaped = LinkProfile.parse(slot={"distribution": "pareto", "delay": "9ms", "jitter": "2ms"})
    assert build_plan("p1", shaped).layout == build_plan("p1", reshaped).layout
    assert build_plan("p1", fixed).layout == build_plan("p1", LinkProfile()).layout
    assert build_plan("p1", shaped).layout != build_plan("p1", fixed).layout


def test_the_dry_run_shows_the_seed():
    (*_, leaf) = render_commands(build_plan("p1", LinkProfile.parse(loss="1%", seed=42)))
    assert leaf.endswith("netem limit 1000 loss random 1% seed 42")


def test_namespace_paths_render_with_nsenter():
    (line, *_) = render_commands(build_plan("eth0", WAN), "/proc/42/ns/net")
    assert line.startswith("nsenter --net=/proc/42/ns/net ethtool -K eth0 ")


def test_cli_dry_run_prints_the_commands():
    result = CliRunner().invoke(app, [
        "shape", "p1", "--netns", "tb1-sw", "--from", "198.18.0.1/32", "--backend", "fallback",
        "--loss", "10%", "--rate", "20mbit", "--dry-run",
    ])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines == render_commands(
        build_plan("p1", {"198.18.0.1": LinkProfile.parse(loss="10%", rate="20mbit")},
                   backend="fallback"),
        "tb1-sw",
    )
    assert any("match ip src 198.18.0.1/32 flowid 1:2" in line for line in lines)


def test_cli_dry_run_json_and_gilbert_elliott_flags():
    result = CliRunner().invoke(app, [
        "shape", "eth0", "--direction", "ingress", "--backend", "netem", "--delay", "20ms",
        "--ge-p", "1%", "--ge-r", "25%", "--dry-run", "--json",
    ])
    assert result.exit_code == 0, result.output
    output = json.loads(result.output)
    assert output["backend"] == "netem"
    assert any("netem limit 1000 delay 20ms loss gemodel 1% 25% 100% 0%" in line
               for line in output["commands"])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--loss", "lots"], "loss"),
        (["--jitter", "5ms"], "jitter needs a delay"),
        (["--ge-r", "5%"], "gilbert_elliott.p"),
        (["--distribution", "cauchy", "--delay", "1ms", "--jitter", "1ms"], "distribution"),
        (["--from", "198.18.0.300"], "source '198.18.0.300'"),
        (["--backend", "fallback", "--delay", "5ms"], "sch_netem"),
    ],
)
def test_cli_bad_flags_name_the_field_and_exit_2(flags, named):
    result = CliRunner().invoke(app, ["shape", "p1", "--backend", "netem", *flags, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert named in result.output
    assert "Traceback" not in result.output


def test_cli_modes_exclude_one_another():
    result = CliRunner().invoke(app, ["shape", "p1", "--show", "--clear"])
    assert result.exit_code == 2 and "exclude one another" in result.output
    result = CliRunner().invoke(app, ["shape", "p1", "--show", "--loss", "1%"])
    assert result.exit_code == 2 and "take no profile" in result.output
