"""A shipped scenario's netem delay, measured on the wire: two-regions' network as the scenario
builds it (real netem qdiscs in the guest), probed pair by pair, then changed as its timeline
changes links (through the same link state) and probed again.

The WAN carries 40 ms with 8 ms of normal jitter. Netem keeps a rate-limited link's packets in
order, so a probe that drew less delay than the one before it waits for it: probes 30 ms apart
are held back only when two draws differ by more than 30 ms, 2.65 standard deviations of their
difference (0.4% of probes, each by a few ms), which moves the median by far less than its
standard error. The median, not the mean: a guest on a busy host delivers a few probes late,
never early, and that moves a mean but hardly a median.
"""

from __future__ import annotations

import pytest

from netem.probe.verdicts import GUEST_TIMING_FLOOR

pytestmark = pytest.mark.netem_kernel

COUNT = 800  # probes per pair
INTERVAL = 0.03  # seconds between probes: more than the WAN's jitter can reorder
# Within 5% of the configured delay. The median of n normal draws has a standard error of
# 1.2533 sigma / sqrt(n): 8 ms * 1.2533 / sqrt(784 arrivals at 2% loss) = 0.36 ms; 5% of 40 ms
# is 2 ms, 5.6 standard errors: a correct link fails it with probability 2e-8 (at 80 ms, 4 ms,
# 11 standard errors).
RELATIVE = 0.05


def median_delay(network, src: int, dst: int, measured) -> float:
    """The median one-way delay from worker src to dst, recorded for the tier's summary."""
    probed = network.measure(src, dst, count=COUNT, interval=INTERVAL, rate=False,
                             timeout=COUNT * INTERVAL + 10)
    assert probed.result.received >= COUNT // 2, probed
    median = probed.result.delay_percentiles[50]
    measured(f"two-regions {src}->{dst}: median delay {median * 1e3:.3f} ms "
             f"({probed.result.received}/{probed.result.sent} probes)")
    return median


def test_two_regions_delay_is_what_the_scenario_says_and_follows_a_change(make_netem_network,
                                                                           measured):
    network = make_netem_network(scenario="two-regions")
    assert network.backend == "netem"
    east, west, east_peer = 0, 4, 1

    wan = median_delay(network, east, west, measured)
    assert abs(wan - 0.040) <= RELATIVE * 0.040, f"east->west median {wan * 1e3:.2f} ms, not 40"
    back = median_delay(network, west, east, measured)
    assert abs(back - 0.040) <= RELATIVE * 0.040, f"west->east median {back * 1e3:.2f} ms, not 40"
    # Inside a region 1 ms, no jitter: 5% of it (50 us) is below what the guest's timers resolve,
    # so the floor applies; never less than the configured delay.
    lan = median_delay(network, east, east_peer, measured)
    assert 0.001 <= lan <= 0.001 + GUEST_TIMING_FLOOR, f"east->east median {lan * 1e3:.2f} ms"

    network.set_link(east, west, delay="80ms", jitter="8ms", distribution="normal", loss="2%",
                     rate="100mbit")
    moved = median_delay(network, east, west, measured)
    assert abs(moved - 0.080) <= RELATIVE * 0.080, f"after the change {moved * 1e3:.2f} ms, not 80"
    assert abs(median_delay(network, west, east, measured) - 0.040) <= RELATIVE * 0.040, \
        "the change of east->west moved west->east too"
