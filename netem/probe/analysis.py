"""What a probe train says about a link: statistics, and verdicts against a profile.

Pure and vectorised: `analyze` turns what a train delivered (`Train`) into loss and its
bursts, one-way delay, reordering, duplication and corruption (`ProbeResult`); `compare` sets
each measured quantity beside what a `LinkProfile` predicts, with a tolerance and a verdict
(`Check`). docs/probes.md explains the models and the tolerances.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from netem.probe.wire import FRAME_OVERHEAD, HEADER
from netem.profile import LinkProfile

# Tolerances of `compare`; docs/probes.md explains each.
DELAY_TOLERANCE = 0.05  # relative
JITTER_TOLERANCE = 0.20  # relative
RATE_TOLERANCE = 0.10  # relative
TIMING_FLOOR = 0.0005  # absolute allowance for delay and jitter: the path's own latency/noise
# In a User-Mode Linux guest one vCPU runs both ends of a train and the shaper, its timers are
# coarser and its system calls slower: 0.65 ms of spread was seen on a link without jitter
# while the host was loaded.
GUEST_TIMING_FLOOR = 0.002
# Standard errors a count may be off (loss, reorder, duplicate, corrupt, bursts, drops): a
# correct link fails one such check with probability 4e-8; a CI run makes about 150 of them, so
# it fails by chance with probability below 1e-5.
Z = 5.5
MIN_BURSTS = 20  # fewer loss bursts than this say nothing about their mean length
# A probe held up by a stall of the sender (in a guest: of its whole kernel, netem's timers
# included) was stamped within this long before or during the stall, or its delivery fell due
# during it and it arrived within this long after the stall ended.
STALL_MARGIN = 0.001
# Delay and jitter are judged on the probes no stall held up, when there are at least this many
# of them (or half the arrivals of a shorter train): the relative standard error of the jitter
# is then at most 1/sqrt(2 * 500) = 3.2%, a sixth of its tolerance.
MIN_TIMED = 500


# ---------------------------------------------------------------------------------------------
# Statistics on sequences (pure, vectorised)


def loss_bursts(lost: np.ndarray) -> np.ndarray:
    """Lengths of the runs of consecutive lost sequence numbers, in sequence order."""
    edges = np.diff(np.concatenate(([0], np.asarray(lost, dtype=np.int8), [0])))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def first_arrivals(seq: np.ndarray) -> np.ndarray:
    """True for the first arrival of each sequence number; the others are duplicates."""
    seq = np.asarray(seq)
    mask = np.zeros(seq.size, dtype=bool)
    mask[np.unique(seq, return_index=True)[1]] = True
    return mask


def late_arrivals(seq: np.ndarray) -> np.ndarray:
    """True where a packet arrives after one with a higher sequence number (RFC 4737's
    "reordered"): the packets that were overtaken."""
    seq = np.asarray(seq)
    late = np.zeros(seq.size, dtype=bool)
    if seq.size > 1:
        late[1:] = seq[1:] < np.maximum.accumulate(seq)[:-1]
    return late


def overtaking_arrivals(seq: np.ndarray) -> np.ndarray:
    """True where a packet arrives before one with a lower sequence number: the packets that
    jumped the queue, which is what netem's `reorder` probability counts."""
    seq = np.asarray(seq)
    early = np.zeros(seq.size, dtype=bool)
    if seq.size > 1:
        early[:-1] = seq[:-1] > np.minimum.accumulate(seq[::-1])[::-1][1:]
    return early


@dataclass(frozen=True)
class Train:
    """What one train delivered, before any statistics.

    `seq`, `sent_ns` and `recv_ns` describe every arrival whose header was intact, in arrival
    order (duplicates included); `payload_ok` says whether its payload was too.
    """

    sent: int
    size: int
    seq: np.ndarray
    sent_ns: np.ndarray
    recv_ns: np.ndarray
    payload_ok: np.ndarray
    malformed: int = 0
    send_errors: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stalls: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    receiver_drops: int = 0
    unread: int = 0
    ended: bool = True
    interval: float = 0.0


@dataclass(frozen=True)
class ProbeResult:
    """What a link did to a probe train. Ratios are 0..1, times in seconds, rates in bits/s of
    Ethernet frames (what a shaper counts)."""

    sent: int
    received: int  # distinct probes that arrived with an intact header
    arrivals: int  # such datagrams, duplicates included
    corrupt: int  # arrivals whose payload was damaged
    malformed: int  # datagrams that were no intact probe of this run (header damaged, foreign)
    loss_ratio: float
    loss_burst_mean: float
    loss_burst_max: int
    loss_bursts: dict[int, int]  # burst length -> how many bursts
    delay_mean: float
    delay_stdev: float
    delay_min: float
    delay_max: float
    delay_percentiles: dict[int, float]  # 50, 90, 99
    reorder_ratio: float  # arrived after a higher sequence number (RFC 4737)
    overtake_ratio: float  # arrived before a lower sequence number
    duplicate_ratio: float
    corrupt_ratio: float
    size: int  # UDP payload of a probe, bytes
    interval: float  # mean spacing of the sends
    send_errors: int
    receiver_drops: int  # datagrams the receiving socket itself dropped (buffer full)
    ended: bool  # an end-of-train marker arrived (else the receiver timed out)
    rate: float | None = None  # from the bulk train
    rate_frames: int = 0
    rate_frame_bytes: int = 0
    rate_offered: float | None = None  # what the bulk train's sender achieved, bits/s
    stalled: int = 0  # arrivals left out of the delay figures: held up by a stall of the sender
    trains: int = 1  # timed trains sent: the ones before the last found the host too busy

    @property
    def frame_bytes(self) -> int:
        return self.size + FRAME_OVERHEAD

    @property
    def too_busy(self) -> bool:
        """Stalls of the sender held up so many probes that too few (MIN_TIMED, or half the
        arrivals of a shorter train) are left to judge delay and jitter on."""
        timed = self.arrivals - self.stalled
        return timed < min(MIN_TIMED, self.arrivals / 2)


def held_by_stalls(windows: np.ndarray, sent_ns: np.ndarray, recv_ns: np.ndarray,
                   margin_ns: int = int(STALL_MARGIN * 1e9)) -> np.ndarray:
    """Which arrivals a stall of the sender may have held up (`windows`: (from, to) ns when it
    did not run): those stamped from `margin_ns` before a stall to its end (the stamp, or the
    packet's way into the link, waited for it), and those that arrived during one or within
    `margin_ns` after it (their delivery fell due while the kernel that releases them did not
    run). A probe merely in flight across a stall, released after it on time, is not held up:
    the selection does not depend on a probe's own delay, so what is left speaks for the link.
    Vectorised; the windows may overlap and come in any order."""
    held = np.zeros(np.shape(sent_ns), dtype=bool)
    if not len(windows):
        return held
    windows = windows[np.argsort(windows[:, 0], kind="stable")]
    starts, ends = windows[:, 0], np.maximum.accumulate(windows[:, 1])
    for stamps, lead, tail in ((sent_ns, margin_ns, 0), (recv_ns, 0, margin_ns)):
        # The last window opening at or before a stamp has the latest end of those before it.
        last = np.searchsorted(starts - lead, stamps, side="right") - 1
        inside = last >= 0
        held[inside] |= stamps[inside] <= ends[last[inside]] + tail
    return held


def analyze(train: Train) -> ProbeResult:
    """The statistics of a train; all vectorised."""
    seq = train.seq.astype(np.int64)
    in_range = (seq >= 0) & (seq < train.sent)
    seq, sent_ns, recv_ns, payload_ok = (
        seq[in_range],
        train.sent_ns[in_range],
        train.recv_ns[in_range],
        np.asarray(train.payload_ok, dtype=bool)[in_range],
    )
    first = first_arrivals(seq)
    received = int(first.sum())
    expected = np.ones(train.sent, dtype=bool)
    expected[train.send_errors] = False
    lost = expected.copy()
    lost[seq] = False
    attempted = int(expected.sum())
    bursts = loss_bursts(lost[expected])
    lengths, counts = np.unique(bursts, return_counts=True)
    timed = ~held_by_stalls(train.stalls, sent_ns, recv_ns)
    delay = (recv_ns[timed] - sent_ns[timed]) / 1e9
    arrivals = seq.size
    corrupt = int((~payload_ok).sum())
    datagrams = arrivals + train.malformed
    ordered = seq[first]
    return ProbeResult(
        sent=attempted,
        received=received,
        arrivals=arrivals,
        corrupt=corrupt,
        malformed=train.malformed,
        loss_ratio=_ratio(attempted - received, attempted),
        loss_burst_mean=float(bursts.mean()) if bursts.size else 0.0,
        loss_burst_max=int(bursts.max()) if bursts.size else 0,
        loss_bursts=dict(zip(lengths.tolist(), counts.tolist(), strict=True)),
        delay_mean=float(delay.mean()) if delay.size else math.nan,
        delay_stdev=float(delay.std()) if delay.size else math.nan,
        delay_min=float(delay.min()) if delay.size else math.nan,
        delay_max=float(delay.max()) if delay.size else math.nan,
        delay_percentiles={
            p: float(v)
            for p, v in zip(
                (50, 90, 99),
                np.percentile(delay, (50, 90, 99)) if delay.size else [math.nan] * 3,
                strict=True,
            )
        },
        reorder_ratio=_ratio(int(late_arrivals(ordered).sum()), received),
        overtake_ratio=_ratio(int(overtaking_arrivals(ordered).sum()), received),
        duplicate_ratio=_ratio(arrivals - received, received),
        corrupt_ratio=_ratio(corrupt + train.malformed, datagrams),
        size=train.size,
        interval=train.interval,
        send_errors=int(train.send_errors.size),
        receiver_drops=train.receiver_drops + train.unread,
        ended=train.ended,
        stalled=int((~timed).sum()),
    )


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else math.nan


def bulk_rate(recv_ns: np.ndarray, frame_bytes: int, *, skip: float = 0.1) -> float:
    """Bits per second of frames arriving back to back, from their kernel arrival stamps.

    The first `skip` of the arrivals is left out: a token bucket lets its burst through at line
    speed before the rate holds. Frames that share the window's first stamp are not counted:
    a segmentation-offload batch that crosses the shaper whole arrives as one clump, which was
    serialised before that instant.
    """
    stamps = np.sort(np.asarray(recv_ns))[int(len(recv_ns) * skip) :]
    if stamps.size < 2 or stamps[-1] == stamps[0]:
        return math.nan
    frames = np.count_nonzero(stamps > stamps[0])
    return float(frames * frame_bytes * 8 / ((stamps[-1] - stamps[0]) / 1e9))


# ---------------------------------------------------------------------------------------------
# Comparing with a profile


@dataclass(frozen=True)
class Check:
    """One measured quantity beside what was configured. `passed` is None when the quantity
    cannot be predicted for this profile (`note` says why)."""

    quantity: str
    unit: str  # "ratio", "seconds", "bits/s", "packets" (a mean length) or "count"
    configured: float
    measured: float
    tolerance: float
    passed: bool | None
    note: str = ""

    def show(self, value: float) -> str:
        """`value` in this check's unit, for a table."""
        if math.isnan(value):
            return "-"
        if self.unit == "ratio":
            return f"{value * 100:.2f}%"
        if self.unit == "seconds":
            return f"{value * 1e3:.3f} ms"
        if self.unit == "bits/s":
            return f"{value / 1e6:.2f} Mbit/s"
        if self.unit == "count":
            return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
        return f"{value:.2f}"


def _check(
    quantity: str, unit: str, expected: float, measured: float, tolerance: float, note: str = ""
) -> Check:
    passed = bool(abs(measured - expected) <= tolerance)  # NaN measured: fails
    return Check(quantity, unit, expected, measured, tolerance, passed, note)


def _binomial(
    quantity: str, expected: float, measured: float, trials: int, note: str = ""
) -> Check:
    """A proportion of independent trials: Z standard errors (at least Z/n, so that an expected 0
    tolerates a stray event or four)."""
    n = max(trials, 1)
    tolerance = Z * math.sqrt(max(expected * (1 - expected), 1 / n) / n)
    return _check(quantity, "ratio", expected, measured, tolerance, note)


def _skipped(quantity: str, unit: str, measured: float, note: str) -> Check:
    return Check(quantity, unit, math.nan, measured, math.nan, None, note)


def _loss_chain(profile: LinkProfile) -> tuple[np.ndarray, np.ndarray]:
    """The loss process as a Markov chain: (per-state loss probability, transition matrix).
    One state for random loss; Gilbert-Elliott's two, whose loss depends on the state entered."""
    ge = profile.gilbert_elliott
    if ge is None:
        return np.array([profile.loss]), np.array([[1.0]])
    return np.array([ge.loss_good, ge.loss_bad]), np.array([[1 - ge.p, ge.p], [ge.r, 1 - ge.r]])


def _stationary(step: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eig(step.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    return vector / vector.sum()


def expected_burst_mean(profile: LinkProfile) -> float:
    """Mean length of a run of consecutive losses (loss correlation aside):
    P(lost) / P(lost, then not lost) for the chain of `_loss_chain`."""
    loss, step = _loss_chain(profile)
    stationary = _stationary(step)
    lost = float(stationary @ loss)
    ends = float((stationary * loss) @ step @ (1 - loss))
    return lost / ends if ends > 0 else math.inf


def _burst_variance(profile: LinkProfile) -> float:
    """Per-probe variance of the loss count that bursts add to the independent case:
    2 (l_bad - l_good)^2 pi_good pi_bad rho / (1 - rho), rho = 1 - p - r (the chain's memory)."""
    ge = profile.gilbert_elliott
    if ge is None or ge.p + ge.r == 0:
        return 0.0
    rho = 1 - ge.p - ge.r
    bad = ge.p / (ge.p + ge.r)
    return max(2 * (ge.loss_bad - ge.loss_good) ** 2 * bad * (1 - bad) * rho / (1 - rho), 0.0)


def default_timing_floor() -> float:
    """The least delay and jitter allowance where this runs: wider inside the sandbox's guest
    (`netem.sandbox` marks it in the environment), whose one vCPU runs both ends and the shaper."""
    return GUEST_TIMING_FLOOR if os.environ.get("TESTBED_IN_GUEST") else TIMING_FLOOR


def compare(configured: LinkProfile, result: ProbeResult,
            timing_floor: float | None = None) -> list[Check]:
    """Every measured quantity beside what `configured` predicts, with a tolerance and a verdict.
    `timing_floor` (seconds) is the least allowance for delay and jitter: the path's own noise
    (default: `default_timing_floor()`).

    Corruption is modelled as netem does it: one flipped bit anywhere in the frame. A flip in the
    Ethernet, IP, UDP or probe header loses the probe (the kernel drops it, or its sequence number
    can no longer be trusted); a flip in the pad arrives as a corrupt probe.
    """
    frame = result.frame_bytes
    # The socket's drop counter also counts datagrams whose UDP checksum field (16 bits) a
    # corrupting link flipped from zero: the kernel then checks the sum and drops them there.
    flips = configured.corrupt * (result.arrivals + result.malformed) * 16 / (8 * frame)
    drops = result.receiver_drops
    checks = [
        _check(
            "receiver drops",
            "count",
            flips,
            drops,
            Z * math.sqrt(flips),
            "the probe's own socket overflowed: loss is overstated" if drops > flips else "",
        ),
    ]
    load = frame * 8 / result.interval if result.interval > 0 else math.inf
    if configured.rate and load > configured.rate / 2:
        note = (
            f"the probe train itself ({load / 1e6:.1f} Mbit/s) loads the link: its own "
            "queueing adds delay and loss; probe more slowly"
        )
        checks += [
            _skipped(name, unit, value, note)
            for name, unit, value in (
                ("loss", "ratio", result.loss_ratio),
                ("loss burst mean", "packets", result.loss_burst_mean),
                ("delay mean", "seconds", result.delay_mean),
                ("jitter (stdev)", "seconds", result.delay_stdev),
            )
        ]
    else:
        checks += [
            _loss_check(configured, result),
            _burst_check(configured, result),
            *_delay_checks(configured, result, timing_floor if timing_floor is not None
                           else default_timing_floor()),
        ]
    checks.append(_reorder_check(configured, result))
    correlated = "netem's correlated generator does not keep the mean rate"
    if configured.duplicate_correlation > 0:
        checks.append(_skipped("duplicate", "ratio", result.duplicate_ratio, correlated))
    else:
        checks.append(
            _binomial("duplicate", configured.duplicate, result.duplicate_ratio, result.received)
        )
    if configured.corrupt_correlation > 0:
        checks.append(_skipped("corrupt", "ratio", result.corrupt_ratio, correlated))
    else:
        hit = configured.corrupt * result.size / frame
        dropped = configured.corrupt * FRAME_OVERHEAD / frame
        checks.append(
            _binomial(
                "corrupt",
                hit / (1 - dropped),
                result.corrupt_ratio,
                result.arrivals + result.malformed,
                f"one flipped bit per frame; {result.size} of its {frame} bytes are the probe's",
            )
        )
    if result.rate is not None:
        if configured.rate is None:
            checks.append(_skipped("rate", "bits/s", result.rate, "no rate configured"))
        else:
            checks.append(
                _check(
                    "rate", "bits/s", configured.rate, result.rate, RATE_TOLERANCE * configured.rate
                )
            )
    if configured.mean_loss >= 1 and result.received == 0:
        # A cut link: nothing arrives, so only the loss (and the receiver's drops) is measured.
        checks = [_skipped(c.quantity, c.unit, c.measured, "nothing arrives over a link with "
                           "100% loss") if math.isnan(c.measured) else c for c in checks]
    return checks


def _loss_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """Z standard errors of the lost count: binomial for independent losses, plus the extra
    variance that bursts add."""
    if configured.loss_correlation > 0:
        return _skipped(
            "loss",
            "ratio",
            result.loss_ratio,
            "netem's correlated generator does not keep the mean loss",
        )
    n = max(result.sent, 1)
    header = configured.corrupt * (FRAME_OVERHEAD + HEADER.size) / result.frame_bytes
    expected = 1 - (1 - configured.mean_loss) * (1 - header)
    independent = max(expected * (1 - expected), 1 / n) / n
    tolerance = Z * math.sqrt(independent + _burst_variance(configured) / n)
    return _check("loss", "ratio", expected, result.loss_ratio, tolerance)


def _burst_check(configured: LinkProfile, result: ProbeResult) -> Check:
    measured = result.loss_burst_mean if result.loss_bursts else math.nan
    if configured.mean_loss == 0:
        return _skipped("loss burst mean", "packets", measured, "no loss configured")
    if configured.loss_correlation > 0:
        return _skipped(
            "loss burst mean",
            "packets",
            measured,
            "netem's correlated generator changes the bursts",
        )
    bursts = sum(result.loss_bursts.values())
    if bursts < MIN_BURSTS:
        return _skipped(
            "loss burst mean", "packets", measured, f"only {bursts} bursts; {MIN_BURSTS} needed"
        )
    expected = expected_burst_mean(configured)
    # Burst lengths taken as geometric with this mean: variance mean*(mean-1).
    tolerance = max(Z * math.sqrt(expected * (expected - 1) / bursts), 0.05 * expected)
    return _check("loss burst mean", "packets", expected, measured, tolerance)


def _early_fraction(configured: LinkProfile) -> float:
    """Fraction of packets netem sends at once, ahead of the delayed ones (gap 0 means tc's 1)."""
    gap = max(configured.gap, 1)
    return configured.reorder / (1 + configured.reorder * (gap - 1))


def _delay_checks(configured: LinkProfile, result: ProbeResult,
                  timing_floor: float) -> list[Check]:
    """Mean and spread of the one-way delay: a mixture of packets sent at once (the reordered
    fraction f) and packets delayed by delay +- jitter, plus the serialisation at the rate."""
    if result.too_busy:
        trains = f" (in the last of {result.trains} trains)" if result.trains > 1 else ""
        note = (f"{result.stalled} of {result.arrivals} probes were held up while the "
                f"sender stalled{trains}: the host was too busy to judge delay; probe again")
        return [
            _skipped("delay mean", "seconds", result.delay_mean, note),
            _skipped("jitter (stdev)", "seconds", result.delay_stdev, note),
        ]
    if configured.rate and configured.jitter:
        note = (
            "with a rate, netem keeps packets in order: each waits for the one ahead, so "
            "delays crowd towards delay + jitter and spread less"
        )
        return [
            _skipped("delay mean", "seconds", result.delay_mean, note),
            _skipped("jitter (stdev)", "seconds", result.delay_stdev, note),
        ]
    early = _early_fraction(configured)
    serialise = result.frame_bytes * 8 / configured.rate if configured.rate else 0.0
    uniform = configured.distribution == "uniform"
    spread = configured.jitter / math.sqrt(3) if uniform else configured.jitter
    mean = (1 - early) * configured.delay + serialise
    stdev = math.sqrt((1 - early) * spread**2 + early * (1 - early) * configured.delay**2)
    checks = [
        _check(
            "delay mean",
            "seconds",
            mean,
            result.delay_mean,
            max(DELAY_TOLERANCE * mean, timing_floor),
        )
    ]
    if configured.delay_correlation > 0:
        checks.append(
            _skipped(
                "jitter (stdev)",
                "seconds",
                result.delay_stdev,
                "netem's correlated generator narrows the spread",
            )
        )
    else:
        checks.append(
            _check(
                "jitter (stdev)",
                "seconds",
                stdev,
                result.delay_stdev,
                max(JITTER_TOLERANCE * stdev, timing_floor),
            )
        )
    return checks


def _reorder_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """The fraction of probes that overtook an earlier one. netem sends a fraction f at once;
    such a probe overtakes unless every probe sent within one delay before it also went at once."""
    if configured.jitter > 0:
        return _skipped(
            "reorder (overtaking)",
            "ratio",
            result.overtake_ratio,
            "jitter reorders packets too; no expected value",
        )
    if configured.reorder_correlation > 0:
        return _skipped(
            "reorder (overtaking)",
            "ratio",
            result.overtake_ratio,
            "netem's correlated generator does not keep the mean rate",
        )
    early = _early_fraction(configured)
    within = int(configured.delay / result.interval) if result.interval > 0 else 0
    expected = early * (1 - early**within)
    return _binomial("reorder (overtaking)", expected, result.overtake_ratio, result.received)
