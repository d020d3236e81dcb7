"""IPv6 across shaped links on the host kernel (root, namespaces; the fallback here): a host's
IPv6 address is in the same rule as its IPv4 one, so the IPv6 datagrams of a lossy pair lose
what that pair's rule says, not what the receiver's catch-all does; IPv6 rules read back from
the kernel as they were given."""

from __future__ import annotations

import math

import pytest

import netem
from netem.probe import probe
from netem.profile import LinkProfile

pytestmark = pytest.mark.netns

LOSS = 0.30  # of the pair 0 -> 1; every other link is perfect, so host 1's catch-all is too
COUNT = 4000  # probes across the pair
# Six standard deviations of the loss ratio of COUNT probes: 6 * sqrt(0.3 * 0.7 / 4000) = 0.043.
# A correct link falls outside with probability 2.3e-9 (binomial). Host 0's neighbour
# solicitations carry its IPv6 address, so they cross the lossy pair too: the probe's warm-up
# marker is sent until it arrives, and in WARM_UP seconds the kernel solicits about once a
# second, all of them lost with probability 0.3^10 = 6e-6: the test's odds of a false failure.
BOUND = 6 * math.sqrt(LOSS * (1 - LOSS) / COUNT)
WARM_UP = 10.0


def test_a_pairs_ipv6_datagrams_lose_what_its_rule_says(make_netem_network, measured):
    network = make_netem_network(4, links={(0, 1): {"loss": f"{LOSS:.0%}"}})
    a, b, c, _ = network
    assert (a.address6, b.address6) == ("fd00:7e57::1", "fd00:7e57::2")
    # One rule for host 0's two addresses (one class, whatever the family); the catch-all is
    # perfect.
    rules = netem.installed("p1", netns=f"{network.prefix}-sw").as_rules()
    assert rules[(a.address, a.address6)].loss == LOSS and rules[None].loss == 0

    lossy = probe(a.netns, b.netns, b.address6, count=COUNT, timeout=WARM_UP)
    measured(f"IPv6 0->1 at {LOSS:.0%}: loss {lossy.loss_ratio:.4f} "
             f"({lossy.received}/{lossy.sent} probes)")
    assert lossy.receiver_drops == 0 and lossy.ended
    assert abs(lossy.loss_ratio - LOSS) <= BOUND, lossy.loss_ratio
    for src, dst in ((c, b), (b, a)):  # the catch-all's links: perfect
        perfect = probe(src.netns, dst.netns, dst.address6, count=1000, timeout=WARM_UP)
        assert perfect.loss_ratio == 0.0, (src.index, dst.index, perfect.loss_ratio)


def test_ipv6_rules_read_back_as_given(make_lab):
    lab = make_lab(2)
    h0, h1 = lab.hosts
    port = h1.switch_port
    rules = {
        (h0.address6, h0.address): LinkProfile.parse(loss="20%", rate="50mbit"),
        "fd00:7e57::/64": LinkProfile.parse(loss="5%"),
        None: LinkProfile.parse(rate="100mbit"),
    }
    netem.apply(port, rules, netns=lab.switch)
    installed = netem.installed(port, netns=lab.switch)
    assert installed.as_rules() == {(h0.address, h0.address6): rules[(h0.address6, h0.address)],
                                    "fd00:7e57::/64": rules["fd00:7e57::/64"], None: rules[None]}
    assert netem.show(port, netns=lab.switch) == {
        h0.address: rules[(h0.address6, h0.address)],
        h0.address6: rules[(h0.address6, h0.address)],
        "fd00:7e57::/64": rules["fd00:7e57::/64"], None: rules[None]}
    netem.clear(port, netns=lab.switch)
    assert netem.show(port, netns=lab.switch) == {}
