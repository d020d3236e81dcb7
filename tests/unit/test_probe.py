"""Probe statistics and wire format on synthetic sequences, and probes on loopback: no root."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netem.distribution import NETEM_DIST_SCALE, sample_table
from netem.probe import (
    HEADER,
    KIND_END,
    STATUS_MALFORMED,
    STATUS_OK,
    STATUS_PAYLOAD_CORRUPT,
    Check,
    ProbeError,
    ProbeResult,
    Train,
    analyze,
    arrival_bunches,
    bulk_rate,
    compare,
    decode,
    encode,
    expected_burst_mean,
    expected_rate,
    first_arrivals,
    held_by_stalls,
    late_arrivals,
    loss_bursts,
    overtaking_arrivals,
    probe,
    wire_bytes,
)
from netem.profile import LinkProfile

RUN = 0xC0FFEE


def slots_of(datagrams: list[bytes], width: int) -> tuple[np.ndarray, np.ndarray]:
    """What the receiver keeps: the first `width` bytes of each datagram and its real length."""
    slots = np.zeros((len(datagrams), width), dtype=np.uint8)
    for row, data in zip(slots, datagrams, strict=True):
        kept = np.frombuffer(data[:width], dtype=np.uint8)
        row[: kept.size] = kept
    return slots, np.array([len(d) for d in datagrams], dtype=np.int64)


def train(seq, *, sent: int, delays=None, payload_ok=None, **fields) -> Train:
    seq = np.asarray(seq, dtype=np.int64)
    sent_ns = seq * 1_000_000
    delays_ns = np.asarray(delays if delays is not None else [0.01] * seq.size) * 1e9
    return Train(
        sent=sent,
        size=128,
        seq=seq,
        sent_ns=sent_ns,
        recv_ns=sent_ns + delays_ns.astype(np.int64),
        payload_ok=np.ones(seq.size, bool) if payload_ok is None else np.asarray(payload_ok),
        interval=0.001,
        **fields,
    )


def perfect(n: int = 10_000, **changes) -> ProbeResult:
    return dataclasses.replace(
        analyze(train(np.arange(n), sent=n, delays=np.zeros(n))), **changes
    )


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.quantity: check for check in checks}


# --- sequence statistics ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lost", "bursts"),
    [
        ([0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [2, 1, 3]),
        ([1, 1, 1], [3]),
        ([0, 0], []),
        ([], []),
        ([1, 0, 1], [1, 1]),
    ],
)
def test_loss_bursts_are_runs_of_consecutive_losses(lost, bursts):
    assert loss_bursts(np.array(lost, dtype=bool)).tolist() == bursts


def test_duplicates_are_every_arrival_after_the_first():
    assert first_arrivals(np.array([0, 1, 1, 2, 0, 3])).tolist() == [1, 1, 0, 1, 0, 1]


def test_late_and_overtaking_arrivals():
    # 3 jumps ahead of 2: 3 overtook, 2 arrived late (after a higher number).
    seq = np.array([0, 1, 3, 2, 4])
    assert late_arrivals(seq).tolist() == [0, 0, 0, 1, 0]
    assert overtaking_arrivals(seq).tolist() == [0, 0, 1, 0, 0]
    # One packet held back behind three: it alone is late, the three overtook it.
    seq = np.array([1, 2, 3, 0, 4])
    assert late_arrivals(seq).tolist() == [0, 0, 0, 1, 0]
    assert overtaking_arrivals(seq).tolist() == [1, 1, 1, 0, 0]
    assert late_arrivals(np.array([5])).tolist() == overtaking_arrivals(np.array([5])).tolist()


def test_summary_of_a_train_with_every_impairment():
    # 10 sent; 3 and 7,8 lost; 5 duplicated; 6 overtakes 4; 9's payload damaged; 2 malformed.
    seq = [0, 1, 2, 6, 4, 5, 5, 9]
    delays = [0.010, 0.012, 0.010, 0.001, 0.014, 0.010, 0.011, 0.010]
    result = analyze(
        train(seq, sent=10, delays=delays, payload_ok=[1, 1, 1, 1, 1, 1, 1, 0], malformed=2)
    )
    assert (result.sent, result.received, result.arrivals) == (10, 7, 8)
    assert result.loss_ratio == pytest.approx(0.3)
    assert result.loss_bursts == {1: 1, 2: 1}
    assert (result.loss_burst_mean, result.loss_burst_max) == (1.5, 2)
    assert result.duplicate_ratio == pytest.approx(1 / 7)
    assert result.reorder_ratio == pytest.approx(2 / 7)  # 4 and 5 arrived after 6
    assert result.overtake_ratio == pytest.approx(1 / 7)  # 6 arrived before 4 and 5
    assert result.corrupt == 1
    assert result.corrupt_ratio == pytest.approx(3 / 10)  # 1 damaged + 2 malformed of 10
    assert result.delay_mean == pytest.approx(np.mean(delays))
    assert result.delay_stdev == pytest.approx(np.std(delays))
    assert (result.delay_min, result.delay_max) == (pytest.approx(0.001), pytest.approx(0.014))
    assert result.delay_percentiles[50] == pytest.approx(np.median(delays))


def test_send_errors_are_not_counted_as_losses():
    result = analyze(train([0, 1, 3], sent=5, send_errors=np.array([2, 4])))
    assert (result.sent, result.loss_ratio, result.send_errors) == (3, 0.0, 2)


def test_an_empty_train_gives_nan_delays_not_an_error():
    result = analyze(train([], sent=100))
    assert result.loss_ratio == 1.0
    assert result.loss_bursts == {100: 1}
    assert math.isnan(result.delay_mean) and math.isnan(result.duplicate_ratio)


def test_bulk_rate_from_even_and_from_clumped_arrivals():
    frame = 1514
    gap = frame * 8 / 10e6 * 1e9  # 10 Mbit/s
    even = (np.arange(1000) * gap).astype(np.int64)
    assert bulk_rate(even, frame) == pytest.approx(10e6, rel=1e-6)
    # Batches of 44 frames that cross the shaper whole and arrive at one instant each.
    clumped = np.repeat(np.arange(25) * 44 * gap, 44).astype(np.int64)
    assert bulk_rate(clumped, frame) == pytest.approx(10e6, rel=1e-6)
    assert math.isnan(bulk_rate(np.array([5]), frame))


# --- wire format --------------------------------------------------------------------------


def test_probes_round_trip():
    datagrams = [encode(RUN, seq, 10**18 + seq, 64) for seq in range(5)]
    datagrams.append(encode(RUN, 5, 7, 64, kind=KIND_END))
    decoded = decode(*slots_of(datagrams, 64), run=RUN, size=64)
    assert decoded.status.tolist() == [STATUS_OK] * 6
    assert decoded.seq.tolist() == list(range(6))
    assert decoded.sent_ns.tolist() == [10**18 + s for s in range(5)] + [7]
    assert decoded.kind.tolist() == [0] * 5 + [KIND_END]


def test_every_single_flipped_bit_is_detected():
    size = 64
    original = np.frombuffer(encode(RUN, 12345, 1_700_000_000_123_456_789, size), np.uint8)
    bits = np.arange(size * 8)
    flipped = np.tile(original, (bits.size, 1))
    flipped[bits, bits // 8] ^= (1 << (bits % 8)).astype(np.uint8)
    decoded = decode(flipped, np.full(bits.size, size), run=RUN, size=size)
    in_header = bits < HEADER.size * 8
    assert (decoded.status[in_header] == STATUS_MALFORMED).all()
    assert (decoded.status[~in_header] == STATUS_PAYLOAD_CORRUPT).all()
    # A damaged payload leaves the header trustworthy: the probe still counts as arrived.
    assert (decoded.seq[~in_header] == 12345).all()


def test_foreign_runs_wrong_sizes_and_short_slots_are_malformed():
    datagrams = [
        encode(RUN + 1, 0, 0, 64),  # another run
        encode(RUN, 0, 0, 64)[:40],  # truncated
        encode(RUN, 0, 0, 64) + b"x",  # too long
        b"",
    ]
    decoded = decode(*slots_of(datagrams, 64), run=RUN, size=64)
    assert decoded.status.tolist() == [STATUS_MALFORMED] * 4
    narrow = decode(np.zeros((2, 8), np.uint8), np.array([64, 64]), run=RUN, size=64)
    assert narrow.status.tolist() == [STATUS_MALFORMED] * 2


def test_a_receiver_that_keeps_only_headers_still_decodes():
    datagrams = [encode(RUN, seq, seq, 1472) for seq in range(3)]
    decoded = decode(*slots_of(datagrams, HEADER.size), run=RUN, size=1472)
    assert decoded.status.tolist() == [STATUS_OK] * 3


@settings(max_examples=300, deadline=None)
@given(
    datagrams=st.lists(st.binary(max_size=200), max_size=20),
    width=st.integers(0, 200),
    size=st.integers(0, 200),
    run=st.integers(0, 2**32 - 1),
)
def test_the_decoder_never_raises_on_arbitrary_bytes(datagrams, width, size, run):
    decoded = decode(*slots_of(datagrams, width), run=run, size=size)
    assert decoded.status.shape == decoded.seq.shape == (len(datagrams),)
    assert set(decoded.status.tolist()) <= {STATUS_OK, STATUS_PAYLOAD_CORRUPT, STATUS_MALFORMED}


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=HEADER.size, max_size=HEADER.size), tail=st.binary(max_size=64))
def test_random_headers_are_not_taken_for_probes(data, tail):
    decoded = decode(*slots_of([data + tail], HEADER.size + 64), run=RUN, size=HEADER.size + 64)
    assert decoded.status.tolist() == [STATUS_MALFORMED]


# --- compare ------------------------------------------------------------------------------


def test_a_perfect_link_passes_against_a_perfect_profile():
    checks = compare(LinkProfile(), perfect())
    assert all(check.passed in (True, None) for check in checks)
    assert by_name(checks)["loss burst mean"].passed is None


def test_a_cut_link_is_judged_on_its_loss_alone():
    checks = by_name(compare(LinkProfile(loss=1.0), analyze(train([], sent=500))))
    assert checks["loss"].passed is True
    assert all(check.passed is None for name, check in checks.items()
               if name not in ("loss", "receiver drops")), checks
    assert checks["delay mean"].note == "nothing arrives over a link with 100% loss"


# 10% loss over 10 000 probes: the standard error is 0.3 points, the tolerance 5.5 of them.
@pytest.mark.parametrize(("measured", "passed"), [(0.116, True), (0.084, True), (0.117, False),
                                                  (0.2, False), (0.05, False)])
def test_loss_within_its_binomial_tolerance(measured, passed):
    check = by_name(compare(LinkProfile.parse(loss="10%"), perfect(loss_ratio=measured)))["loss"]
    assert check.tolerance == pytest.approx(5.5 * math.sqrt(0.1 * 0.9 / 10_000))
    assert check.passed is passed


def test_marked_probes_are_counted_once_each_of_what_was_sent():
    marks = [True, False, True, True, False]  # seq 2 arrives twice, marked both times
    result = analyze(train([0, 1, 2, 2, 4], sent=5, marked=np.array(marks), ecn_capable=True))
    assert (result.marked, result.marked_ratio, result.ecn_capable) == (2, 0.4, True)
    assert analyze(train([0, 1], sent=2)).marked == 0  # no ECN fields read: none marked


def test_a_link_with_ecn_is_judged_on_marks_instead_of_losses():
    """On a link with `ecn`, ECN-capable probes the loss model takes arrive marked CE: the
    marks carry the configured loss and the loss is only what corruption would add; probes
    that were not ECN-capable are lost as on any link, and their marks are not judged."""
    profile = LinkProfile.parse(loss="10%", ecn=True)
    marking = by_name(compare(profile, perfect(ecn_capable=True, marked_ratio=0.1)))
    assert marking["loss"].passed is True and marking["CE marks"].passed is True
    assert marking["loss burst mean"].passed is None
    assert by_name(compare(profile, perfect(ecn_capable=True, loss_ratio=0.1)))[
        "loss"].passed is False  # dropped where it should have marked
    assert by_name(compare(profile, perfect(ecn_capable=True, marked_ratio=0.2)))[
        "CE marks"].passed is False
    plain = by_name(compare(profile, perfect(loss_ratio=0.1)))
    assert plain["loss"].passed is True and plain["CE marks"].passed is None
    unexpected = by_name(compare(LinkProfile(), perfect(ecn_capable=True, marked_ratio=0.01)))
    assert unexpected["CE marks"].passed is False  # marks where no ecn was configured


def test_loss_tolerance_widens_as_the_train_shortens():
    check = by_name(compare(LinkProfile.parse(loss="10%"), perfect(1250, loss_ratio=0.1)))["loss"]
    assert check.tolerance == pytest.approx(5.5 * math.sqrt(0.1 * 0.9 / 1250))


def test_a_link_with_twice_the_loss_or_the_wrong_delay_fails():
    """What a probe must catch: a link shaped with twice the loss asked for, or another delay."""
    assert by_name(compare(LinkProfile.parse(loss="5%"),
                           perfect(5000, loss_ratio=0.1)))["loss"].passed is False
    assert by_name(compare(LinkProfile.parse(loss="1%"),
                           perfect(5000, loss_ratio=0.02)))["loss"].passed is False
    late = by_name(compare(LinkProfile.parse(delay="20ms"), perfect(delay_mean=0.04)))
    assert late["delay mean"].passed is False


@pytest.mark.parametrize(("mean", "passed"), [(0.0209, True), (0.0191, True), (0.0211, False)])
def test_delay_mean_within_five_percent(mean, passed):
    profile = LinkProfile.parse(delay="20ms", jitter="5ms")
    result = perfect(delay_mean=mean, delay_stdev=0.005 / math.sqrt(3))
    checks = by_name(compare(profile, result))
    assert checks["delay mean"].passed is passed
    assert checks["jitter (stdev)"].configured == pytest.approx(0.005 / math.sqrt(3))
    assert checks["jitter (stdev)"].passed is True


def test_jitter_of_a_table_distribution_is_its_standard_deviation():
    profile = LinkProfile.parse(delay="20ms", jitter="5ms", distribution="normal")
    check = by_name(compare(profile, perfect(delay_mean=0.02, delay_stdev=0.0061)))
    assert check["jitter (stdev)"].configured == pytest.approx(0.005)
    assert check["jitter (stdev)"].passed is False  # 22% off


@pytest.mark.parametrize(("rate", "passed"), [(10.9e6, True), (9.1e6, True), (8.9e6, False)])
def test_rate_within_ten_percent(rate, passed):
    checks = by_name(compare(LinkProfile.parse(rate="10mbit"), perfect(rate=rate)))
    assert checks["rate"].passed is passed
    # A 170-byte probe takes 136 us to serialise at 10 Mbit/s: that is its expected delay.
    assert checks["delay mean"].configured == pytest.approx(170 * 8 / 10e6)


def test_rate_is_only_checked_when_measured():
    assert "rate" not in by_name(compare(LinkProfile.parse(rate="10mbit"), perfect()))


def test_reorder_expects_the_fraction_netem_sends_ahead():
    profile = LinkProfile.parse(delay="10ms", reorder="25%")
    # interval 1 ms: 10 probes within one delay; an early probe overtakes unless all 10 before
    # it went early too (0.25**10, negligible).
    result = perfect(overtake_ratio=0.25)
    checks = by_name(compare(profile, result))
    assert checks["reorder (overtaking)"].configured == pytest.approx(0.25 * (1 - 0.25**10))
    assert checks["reorder (overtaking)"].passed is True
    assert checks["delay mean"].configured == pytest.approx(0.0075)
    assert checks["jitter (stdev)"].configured == pytest.approx(0.01 * math.sqrt(0.25 * 0.75))


def test_no_reorder_is_expected_without_jitter_and_none_is_predicted_with_it():
    checks = by_name(compare(LinkProfile(), perfect(overtake_ratio=0.01)))
    assert checks["reorder (overtaking)"].passed is False
    jittery = LinkProfile.parse(delay="20ms", jitter="5ms")
    assert by_name(compare(jittery, perfect()))["reorder (overtaking)"].passed is None


def test_binomial_tolerances_scale_with_the_number_of_probes():
    profile = LinkProfile.parse(duplicate="5%")
    small = by_name(compare(profile, perfect(1000, duplicate_ratio=0.05)))["duplicate"]
    large = by_name(compare(profile, perfect(100_000, duplicate_ratio=0.05)))["duplicate"]
    assert small.tolerance == pytest.approx(5.5 * math.sqrt(0.05 * 0.95 / 1000))
    assert large.tolerance == pytest.approx(small.tolerance / 10)


def test_corruption_expected_only_where_the_flip_reaches_the_payload():
    profile = LinkProfile.parse(corrupt="10%")
    result = perfect(size=1024, corrupt_ratio=0.096)
    checks = by_name(compare(profile, result))
    frame = 1024 + 42
    assert checks["corrupt"].configured == pytest.approx(
        0.1 * 1024 / frame / (1 - 0.1 * 42 / frame)
    )
    # Flips in the 42 bytes of Ethernet/IP/UDP headers and the 32-byte probe header lose it.
    assert checks["loss"].configured == pytest.approx(0.1 * 74 / frame)


def test_correlated_generators_are_reported_not_checked():
    profile = LinkProfile.parse(
        loss="10%", loss_correlation="25%", duplicate="1%", duplicate_correlation="10%"
    )
    checks = by_name(compare(profile, perfect()))
    for name in ("loss", "loss burst mean", "duplicate"):
        assert checks[name].passed is None
        assert "correlated" in checks[name].note


def test_receiver_drops_fail_the_comparison():
    checks = by_name(compare(LinkProfile(), perfect(receiver_drops=3)))
    assert checks["receiver drops"].passed is False


def test_a_corrupting_link_may_make_the_socket_drop_a_few_datagrams():
    # A flip in the UDP checksum field (16 of the frame's 1066 * 8 bits) turns the zero sum
    # into a wrong one: the kernel drops the datagram at the socket and counts it there.
    profile = LinkProfile.parse(corrupt="5%")
    check = by_name(compare(profile, perfect(5000, size=1024, receiver_drops=1)))["receiver drops"]
    assert check.configured == pytest.approx(0.05 * 5000 * 16 / (8 * 1066))
    assert check.passed is True
    overflow = by_name(compare(profile, perfect(5000, size=1024, receiver_drops=40)))
    assert overflow["receiver drops"].passed is False


def test_expected_burst_lengths():
    assert expected_burst_mean(LinkProfile.parse(loss="30%")) == pytest.approx(1 / 0.7)
    simple = LinkProfile.parse(gilbert_elliott={"p": "2%", "r": "25%"})
    assert expected_burst_mean(simple) == pytest.approx(4.0)
    # Losing only half the packets in the bad state breaks its bursts up.
    leaky = LinkProfile.parse(gilbert_elliott={"p": "2%", "r": "25%", "1-h": "50%"})
    assert expected_burst_mean(leaky) < 2


def test_burst_check_needs_enough_bursts():
    profile = LinkProfile.parse(gilbert_elliott={"p": "1%", "r": "25%"})
    few = by_name(compare(profile, perfect(loss_bursts={4: 5}, loss_burst_mean=4.0)))
    assert few["loss burst mean"].passed is None
    many = by_name(compare(profile, perfect(loss_bursts={4: 100}, loss_burst_mean=4.0)))
    assert many["loss burst mean"].passed is True


def test_check_values_are_shown_in_their_units():
    def show(unit: str, value: float) -> str:
        return Check("q", unit, 0, 0, 0, True).show(value)

    assert show("ratio", 0.1234) == "12.34%"
    assert show("seconds", 0.02) == "20.000 ms"
    assert show("bits/s", 1e8) == "100.00 Mbit/s"
    assert show("count", 3) == "3"
    assert show("count", 0.47) == "0.5"
    assert show("packets", 1.5) == "1.50"
    assert show("ratio", math.nan) == "-"


def test_bursty_loss_widens_the_loss_tolerance_by_its_extra_variance():
    bursty = LinkProfile.parse(gilbert_elliott={"p": "2%", "r": "25%"})
    check = by_name(compare(bursty, perfect(30_000, loss_ratio=0.074)))["loss"]
    # rho = 0.73: consecutive losses are dependent; the extra variance per probe is
    # 2 pi_good pi_bad rho / (1 - rho).
    bad = 0.02 / 0.27
    extra = 2 * bad * (1 - bad) * 0.73 / 0.27
    mean = 0.074  # the chain's stationary loss
    assert check.tolerance == pytest.approx(5.5 * math.sqrt((mean * (1 - mean) + extra) / 30_000),
                                            rel=0.01)
    independent = by_name(compare(LinkProfile.parse(loss="7%"), perfect(30_000)))["loss"]
    assert independent.tolerance == pytest.approx(5.5 * math.sqrt(0.07 * 0.93 / 30_000))


def test_a_probe_train_that_loads_the_rate_is_not_judged_on_loss_or_delay():
    # 170-byte frames every 100 us are 13.6 Mbit/s: more than a 10 Mbit/s link carries.
    result = perfect(interval=0.0001, loss_ratio=0.2, delay_mean=0.05, rate=10e6)
    checks = by_name(compare(LinkProfile.parse(rate="10mbit"), result))
    for name in ("loss", "delay mean", "jitter (stdev)"):
        assert checks[name].passed is None
        assert "13.6 Mbit/s" in checks[name].note
    assert checks["rate"].passed is True


def test_delay_under_a_rate_with_jitter_is_not_predicted():
    profile = LinkProfile.parse(delay="40ms", jitter="8ms", rate="100mbit")
    checks = by_name(compare(profile, perfect(delay_mean=0.045)))
    assert checks["delay mean"].passed is None
    assert "in order" in checks["delay mean"].note


# --- rate overheads, delay tables from samples, slots ----------------------------------------


def test_netem_charges_packet_and_cell_overheads_to_the_rate():
    # sch_netem.c's packet_time_ns: 590 + 8 bytes take 13 cells of 48, each 53 bytes long.
    atm = LinkProfile.parse(rate="10mbit", packet_overhead=8, cell_size=48, cell_overhead=5)
    assert wire_bytes(atm, 590) == 13 * 53
    assert wire_bytes(atm, 40) == 53  # 48 bytes fill one cell exactly
    assert wire_bytes(LinkProfile.parse(rate="10mbit", packet_overhead=100), 590) == 690
    assert expected_rate(LinkProfile.parse(rate="10mbit"), 590) == 10e6


@pytest.mark.parametrize(("rate", "passed"), [(8.56e6, True), (10e6, False)])
def test_a_rate_with_overheads_expects_the_frames_share(rate, passed):
    """590-byte frames are charged 689 bytes of an ATM link's 10 Mbit/s: 8.56 Mbit/s of frames
    arrive, and a link that ignored the cells (10 Mbit/s of frames) fails."""
    atm = LinkProfile.parse(rate="10mbit", packet_overhead=8, cell_size=48, cell_overhead=5)
    checks = by_name(compare(atm, perfect(rate=rate, rate_frame_bytes=590)))
    assert checks["rate"].configured == pytest.approx(10e6 * 590 / 689)
    assert checks["rate"].passed is passed
    assert "charged 689 bytes" in checks["rate"].note
    # A 170-byte probe is charged 4 cells: 212 bytes to serialise at 10 Mbit/s.
    assert checks["delay mean"].configured == pytest.approx(212 * 8 / 10e6)


def test_overheads_count_in_the_load_a_probe_train_puts_on_the_rate():
    # 170 + 100 bytes every 400 us are 5.4 Mbit/s: more than half of 10 Mbit/s.
    heavy = LinkProfile.parse(rate="10mbit", packet_overhead=100)
    checks = by_name(compare(heavy, perfect(interval=0.0004)))
    assert checks["loss"].passed is None and "5.4 Mbit/s" in checks["loss"].note


def lognormal_samples(path: Path) -> Path:
    """2,000 heavy-tailed delays in ms, one a line."""
    delays = np.random.default_rng(7).lognormal(np.log(20.0), 0.5, 2000)
    path.write_text("".join(f"{delay:.3f}\n" for delay in delays))
    return path


def delays_train(delays: np.ndarray, interval: float = 0.0004) -> ProbeResult:
    n = delays.size
    sent_ns = (np.arange(n) * interval * 1e9).astype(np.int64)
    return analyze(Train(sent=n, size=128, seq=np.arange(n), sent_ns=sent_ns,
                         recv_ns=sent_ns + (delays * 1e9).astype(np.int64),
                         payload_ok=np.ones(n, bool), interval=interval))


def test_delay_quantiles_of_a_table_built_from_samples(tmp_path):
    """Delays drawn as netem draws them from the table (delay + jitter * entry / 8192) match the
    samples' quantiles; delays of the same mean and spread, drawn uniformly, miss both ends."""
    samples = lognormal_samples(tmp_path / "delays.txt")
    profile = LinkProfile.parse(distribution={"samples": str(samples), "unit": "ms"})
    table = np.asarray(sample_table(samples).table) / NETEM_DIST_SCALE
    draws = np.random.default_rng(3).integers(0, table.size, 10_000)
    checks = by_name(compare(profile, delays_train(profile.delay + profile.jitter * table[draws]),
                             timing_floor=0.002))
    measured = np.loadtxt(samples) / 1e3
    for p in (10, 50, 90, 99):
        check = checks[f"delay p{p}"]
        assert check.passed is True, check
        assert check.configured == pytest.approx(np.percentile(measured, p), abs=1e-6)
        assert check.tolerance > 0.002  # the probes' count and the table's steps, then the floor
    # A heavy tail's band is wider above: the tolerance is its wider side.
    assert checks["delay p99"].tolerance > checks["delay p50"].tolerance
    # The table cuts the tail at 4 jitters: its spread is a little below the jitter.
    assert checks["jitter (stdev)"].configured < profile.jitter
    assert checks["jitter (stdev)"].passed is True and checks["delay mean"].passed is True

    uniform = profile.delay + profile.jitter * np.random.default_rng(4).uniform(
        -math.sqrt(3), math.sqrt(3), 10_000)
    flat = by_name(compare(profile, delays_train(uniform), timing_floor=0.002))
    assert flat["delay p10"].passed is False and flat["delay p99"].passed is False


def test_only_a_table_built_from_samples_has_its_quantiles_checked():
    checks = by_name(compare(LinkProfile.parse(delay="20ms", jitter="5ms"), perfect()))
    assert not [name for name in checks if name.startswith("delay p")]


def slotted_arrivals(sent: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Arrival times (s) of probes sent at `sent` (s) through netem's slots (sch_netem.c,
    netem_dequeue): a packet that finds the last slot past starts the next, `gaps[k]` later;
    a slot lets go every packet that came before it opened."""
    arrivals = np.empty(sent.size)
    held: list[int] = []
    opens, drawn = -1.0, iter(gaps)
    for index, stamp in enumerate(sent):
        if held and opens <= stamp:
            arrivals[held], held = opens, []
        if not held and opens < stamp:
            opens = stamp + next(drawn)
        held.append(index)
    arrivals[held] = opens
    return arrivals


def slot_train(sent: np.ndarray, arrivals: np.ndarray, interval: float) -> ProbeResult:
    n = arrivals.size
    return analyze(Train(sent=n, size=128, seq=np.arange(n),
                         sent_ns=(sent * 1e9).astype(np.int64),
                         recv_ns=(arrivals * 1e9).astype(np.int64),
                         payload_ok=np.ones(n, bool), interval=interval))


def test_arrival_bunches_are_runs_closer_than_half_the_send_interval():
    # Probes sent every ms arrive in three runs; the first-sent probe of each waited 3, 2, 1 ms.
    sent = np.array([0, 1, 2, 3, 4, 5]) * 1_000_000
    recv = np.array([3_000, 3_010, 3_020, 5_000, 5_010, 6_000]) * 1000
    assert arrival_bunches(sent, recv, 0.001) == (3, pytest.approx(0.002))
    assert arrival_bunches(sent[::-1], recv[::-1], 0.001) == (3, pytest.approx(0.002))
    empty = arrival_bunches(sent[:0], recv[:0], 0.001)
    assert empty[0] == 0 and math.isnan(empty[1])


def test_the_first_probe_of_a_slots_bunch_waits_a_slot_gap():
    """However the sender is paced: here every 0.4 ms, then with gaps of up to 3 ms."""
    profile = LinkProfile.parse(slot={"min_delay": "5ms", "max_delay": "10ms", "max_packets": 64})
    rng = np.random.default_rng(11)
    gaps = rng.uniform(0.005, 0.010, 10_000)
    for spacing in (np.full(10_000, 0.0004), rng.choice([0.0002, 0.0003, 0.003], 10_000)):
        sent = np.cumsum(spacing)
        result = slot_train(sent, slotted_arrivals(sent, gaps), spacing.mean())
        checks = by_name(compare(profile, result, timing_floor=0.0005))
        assert checks["slot wait"].configured == pytest.approx(0.0075)
        assert checks["slot wait"].passed is True, checks["slot wait"]
        assert checks["delay mean"].passed is None and "slot" in checks["delay mean"].note
    # A link whose slots came 10-15 ms apart, or one without slots, fails.
    sent = np.arange(10_000) * 0.0004
    later = slot_train(sent, slotted_arrivals(sent, gaps + 0.005), 0.0004)
    assert by_name(compare(profile, later))["slot wait"].passed is False
    assert by_name(compare(profile, perfect()))["slot wait"].passed is False


def test_slot_wait_is_not_predicted_where_the_slots_limits_cut_a_bunch():
    # Up to 51 probes (at a catching-up sender's pace) may wait for a 10 ms slot; 8 may leave.
    profile = LinkProfile.parse(slot={"min_delay": "5ms", "max_delay": "10ms", "max_packets": 8})
    check = by_name(compare(profile, perfect(interval=0.0004)))["slot wait"]
    assert check.passed is None and "lets 8 go" in check.note


@pytest.mark.parametrize(("address", "largest_mtu"), [("127.0.0.1", 65_535), ("::1", 65_536)])
def test_probes_go_over_ipv4_and_ipv6(address, largest_mtu):
    """Over IPv6 too the probes travel without a UDP checksum (both ends ask the kernel for it),
    and a bulk datagram fills the path MTU behind that family's headers (IPv4 caps the path
    MTU at 65,535 bytes)."""
    result = probe(None, None, address, count=200, interval=0.0001, rate_duration=0.1)
    assert (result.received, result.corrupt, result.malformed) == (200, 0, 0)
    assert result.rate_frames > 0
    mtu = min(int(Path("/sys/class/net/lo/mtu").read_text()), largest_mtu)
    assert result.rate_frame_bytes == mtu + 14  # an Ethernet header in front of the datagram


def test_bad_addresses_and_namespaces_are_clear_errors():
    with pytest.raises(ProbeError, match="expected an IPv4 address"):
        probe(None, None, "receiver")
    with pytest.raises(ProbeError, match="'tb-no-such-ns'"):
        probe("tb-no-such-ns", "tb-no-such-ns", "198.18.0.2")
    with pytest.raises(ProbeError, match="count"):
        probe(None, None, "127.0.0.1", count=0)


# --- stalls of the sender -------------------------------------------------------------------


def test_probes_a_stall_held_up_leave_the_delay_figures():
    """Probes 1 ms apart, 10 ms each; the guest's kernel did not run from 100 to 150 ms (the
    sender saw a late wake-up): the probes due then came at 150 ms, the sender went on from
    there. Those and the one stamped at the stall's end are counted apart; the probes in flight
    before it and released on time are not; the delay stays the link's."""
    n = 1000
    index = np.arange(n)
    sent_ns = np.where(index < 100, index, index + 50) * 1_000_000
    delays_ns = np.full(n, 10_000_000)
    held = (index >= 90) & (index < 100)
    delays_ns[held] = 150_000_000 - sent_ns[held]
    stall = np.array([[100_000_000, 150_000_000]])
    stalled = Train(sent=n, size=128, seq=index, sent_ns=sent_ns, recv_ns=sent_ns + delays_ns,
                    payload_ok=np.ones(n, bool), interval=0.001, stalls=stall)
    result = analyze(stalled)
    assert result.stalled == int(held.sum()) + 1  # and probe 100, stamped as the stall ended
    assert result.delay_mean == pytest.approx(0.010) and result.delay_stdev == pytest.approx(0)
    unfiltered = analyze(dataclasses.replace(stalled, stalls=np.zeros((0, 2), dtype=np.int64)))
    assert unfiltered.stalled == 0 and unfiltered.delay_stdev > 0.003


@pytest.mark.parametrize("windows", [[[10, 20], [40, 50]], [[40, 50], [10, 20], [15, 18]]])
def test_held_by_stalls_finds_the_probes_stamped_or_released_in_a_stall(windows):
    sent = np.array([0, 5, 9, 15, 25, 30, 45, 51])
    recv = np.array([9, 12, 30, 35, 35, 41, 70, 53])
    held = held_by_stalls(np.array(windows), sent, recv, margin_ns=2)
    assert held.tolist() == [False, True, True, True, False, True, True, False]
    assert not held_by_stalls(np.zeros((0, 2), dtype=np.int64), sent, recv).any()


def test_a_host_too_busy_to_judge_delay_skips_the_delay_checks():
    profile = LinkProfile.parse(delay="10ms")
    busy = perfect(delay_mean=0.0105, delay_stdev=0.003, stalled=9_800)  # 200 left
    checks = by_name(compare(profile, busy))
    assert checks["delay mean"].passed is None and "too busy" in checks["delay mean"].note
    assert checks["jitter (stdev)"].passed is None
    # Most probes held up, enough left: judged on those.
    mostly_held = perfect(delay_mean=0.0100, delay_stdev=0.0, stalled=9_000)
    assert by_name(compare(profile, mostly_held))["delay mean"].passed is True
    calm = perfect(delay_mean=0.0100, delay_stdev=0.0, stalled=10)
    assert by_name(compare(profile, calm))["delay mean"].passed is True


@pytest.mark.parametrize(("busy_trains", "sent", "judged"), [(0, 1, True), (2, 3, True),
                                                             (3, 3, False)])
def test_a_train_the_host_was_too_busy_to_time_is_sent_again(monkeypatch, busy_trains, sent,
                                                             judged):
    """The engine's trains are stood in for by synthetic ones: the first `busy_trains` stalled
    while every probe was in flight, the rest did not."""
    n, sends = 1000, []
    stalled = np.array([[0, 10**12]])

    def run_train(*args, **kwargs) -> Train:
        sends.append(kwargs)
        busy = len(sends) <= busy_trains
        return train(np.arange(n), sent=n, **({"stalls": stalled} if busy else {}))

    monkeypatch.setattr("netem.probe.engine.run_train", run_train)
    result = probe("a", "b", "198.18.0.2", count=n, trains=3)
    assert len(sends) == sent and result.trains == sent and result.too_busy is not judged
    delay = by_name(compare(LinkProfile.parse(delay="10ms"), result))["delay mean"]
    assert delay.passed is (True if judged else None)
    if not judged:
        assert "in the last of 3 trains" in delay.note
    with pytest.raises(ProbeError, match="trains: expected at least 1"):
        probe("a", "b", "198.18.0.2", trains=0)
