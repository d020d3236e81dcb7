"""IPv6 across netem-shaped links (the UML guest's kernel): a host's IPv6 address is in the same
rule as its IPv4 one, so host 0's IPv6 datagrams to host 1 are lost and delayed as that pair's
rule says, and another host's as its own link says."""

from __future__ import annotations

import math

import pytest

from netem.probe import probe
from netem.probe.verdicts import GUEST_TIMING_FLOOR

pytestmark = pytest.mark.netem_kernel

LOSS, DELAY = 0.30, 0.020  # the pair 0 -> 1
OTHERS = 0.005  # every other link's delay, lossless
COUNT = 4000  # probes across the pair
# Six standard deviations of the loss ratio of COUNT probes: 6 * sqrt(0.3 * 0.7 / 4000) = 0.043.
# A correct link falls outside with probability 2.3e-9 (binomial). Host 0's neighbour
# solicitations carry its IPv6 address, so they cross the lossy pair too: the probe's warm-up
# marker is sent until it arrives, and in WARM_UP seconds the kernel solicits about once a
# second, all of them lost with probability 0.3^10 = 6e-6: the test's odds of a false failure.
BOUND = 6 * math.sqrt(LOSS * (1 - LOSS) / COUNT)
WARM_UP = 10.0


def test_a_pairs_ipv6_datagrams_lose_and_wait_what_its_rule_says(make_netem_network, measured):
    network = make_netem_network(4, delay=f"{OTHERS * 1e3:g}ms",
                                 links={(0, 1): {"delay": f"{DELAY * 1e3:g}ms",
                                                 "loss": f"{LOSS:.0%}"}})
    assert network.backend == "netem"
    a, b, c, _ = network

    lossy = probe(a.netns, b.netns, b.address6, count=COUNT, timeout=WARM_UP)
    measured(f"IPv6 0->1 at {LOSS:.0%}, {DELAY * 1e3:g} ms: loss {lossy.loss_ratio:.4f}, "
             f"median delay {lossy.delay_percentiles[50] * 1e3:.3f} ms")
    assert lossy.receiver_drops == 0 and lossy.ended
    assert abs(lossy.loss_ratio - LOSS) <= BOUND, lossy.loss_ratio
    # netem holds every packet the delay; a guest on a busy host delivers some later still.
    assert DELAY <= lossy.delay_min <= lossy.delay_percentiles[50] < DELAY + GUEST_TIMING_FLOOR

    other = probe(c.netns, b.netns, b.address6, count=1000, timeout=WARM_UP)
    measured(f"IPv6 2->1: loss {other.loss_ratio:.4f}, "
             f"median delay {other.delay_percentiles[50] * 1e3:.3f} ms")
    assert other.loss_ratio == 0.0
    assert OTHERS <= other.delay_min <= other.delay_percentiles[50] < OTHERS + GUEST_TIMING_FLOOR
