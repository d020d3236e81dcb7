"""The key-value service over a WAN-like link: 20 ms each way and 5% loss in both directions.
Every request must get through (retries), never be applied twice, and fail within its deadline
when the network is cut."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.netem(delay="20ms", loss="5%")


def test_every_request_gets_through_the_lossy_link(run_load):
    stats = run_load(requests=50)
    assert stats["failed"] == 0 and stats["wrong"] == 0, stats
    # 100 calls crossing 5% loss each way: about 10% of them need a second attempt.
    assert stats["retries"] > 0, stats


def test_latency_is_at_least_the_round_trip(run_load):
    stats = run_load(requests=20)
    assert stats["failed"] == 0, stats
    assert 40 <= stats["latency_p50_ms"] < 200, stats


@pytest.mark.netem(delay="20ms", loss="5%", links={(0, 1): {"delay": "20ms", "loss": "25%"}})
def test_a_very_lossy_uplink_only_costs_retries(run_load):
    # A generous deadline: the lossy link loses ARP too, and a lost neighbour lookup costs
    # the kernel a second or more before it asks again.
    stats = run_load(requests=20, deadline=10.0)
    assert stats["failed"] == 0 and stats["wrong"] == 0, stats
    assert stats["retries"] >= 2, stats  # about 16 expected


def test_requests_fail_within_their_deadline_during_a_partition(netem_network, run_load):
    netem_network.partition([(0, 1), (1, 0)])
    begun = time.monotonic()
    stats = run_load(requests=2, deadline=1.0)
    assert stats["failed"] == 2, stats
    assert time.monotonic() - begun < 10  # two deadlines, plus starting the client

    netem_network.heal()
    stats = run_load(requests=10)
    assert stats["failed"] == 0, stats


def test_the_link_is_what_the_suite_assumes(netem_network):
    measured = netem_network.measure(0, 1)
    measured.assert_passed("loss")
    # The delay most packets see: a guest on a busy host delivers some of them late, which
    # moves the mean but not the median.
    assert 20 <= measured.result.delay_percentiles[50] * 1e3 < 22, measured
