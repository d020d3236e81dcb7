"""Probes: numbered, timestamped UDP trains that measure what a link really does.

Both ends live in one process. A socket stays in the network namespace it was created in, so the
receiving socket is opened inside the destination namespace and the sending one inside the source
namespace; one event loop paces the sender and drains the receiver. No helper processes, pipes or
readiness handshakes: the receiver is bound before the first probe leaves.

Timing: the sender writes CLOCK_REALTIME into each probe just before sending it; the receiving
kernel stamps the datagram (SO_TIMESTAMPNS, the same clock of the same kernel) when it reaches the
destination namespace, so how late the receiving loop gets to run (slow in a UML guest) never
enters the one-way delay.

Corruption: probes go out with a zero UDP checksum (SO_NO_CHECK). Otherwise the receiving kernel
would silently drop every datagram whose payload netem damaged, and corruption would look like
loss. Each probe's payload is a pad derived from the run id, and its header carries a check word,
so any flipped bit is detected (vectorised, after the train).

Throughput comes from a separate bulk train of MTU-sized datagrams sent with UDP segmentation
offload (one system call per ~44 datagrams: a UML guest cannot send 100 Mbit/s otherwise), from
the spacing of their kernel arrival stamps while the shaper's queue is kept busy.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import secrets
import select
import socket
import struct
import time
from dataclasses import dataclass, field, replace

import numpy as np

from netem.namespace import NamespaceError, udp_socket_in
from netem.profile import LinkProfile

MAGIC = b"NPRB"
VERSION = 1
# A warm-up marker opens every train (and resolves the receiver's link-layer address, whose
# request a lossy link may drop: the probes would then wait a second in the neighbour queue).
KIND_PROBE, KIND_END, KIND_WARMUP = 0, 1, 2
# magic, version, kind, reserved, run id, sequence number, send time (ns), check word
HEADER = struct.Struct("!4sBBHIIQQ")
HEADER_DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("version", "u1"),
        ("kind", "u1"),
        ("reserved", ">u2"),
        ("run", ">u4"),
        ("seq", ">u4"),
        ("sent_ns", ">u8"),
        ("check", ">u8"),
    ]
)
# Odd multipliers: a flipped bit in the sequence number or the send time always changes the
# check word (an odd number times 2**k is never 0 mod 2**64).
_K_SEQ, _K_SENT, _K_ID = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_MASK64 = 2**64 - 1

FRAME_OVERHEAD = 14 + 20 + 8  # Ethernet, IPv4 and UDP headers in front of a probe
DEFAULT_SIZE = 128  # UDP payload of a timed probe: small, so a 10 Mbit/s link is not congested
DEFAULT_INTERVAL = 0.0004  # 2500 probes/s: a UML guest keeps up with this, sending and receiving
DEFAULT_COUNT = 5000
END_SPACING = 0.01  # end-of-train markers repeat this often until one arrives
# A probe whose send call returned this long after its stamp was taken had its sender
# descheduled in between: its one-way delay would include that, so it is left out of the
# delay statistics (and counted, `send_stalls`).
SEND_STALL = 0.001
LINGER_MARGIN = 0.05  # extra wait after an end marker for probes still held by the link

# Linux socket options that Python's socket module does not name.
SO_NO_CHECK, SO_RCVBUFFORCE, SO_TIMESTAMPNS, SO_RXQ_OVFL = 11, 33, 35, 40
UDP_SEGMENT, IP_MTU = 103, 14
RECEIVE_BUFFER = 64 << 20  # holds a whole bulk train that is drained only after it was sent
GSO_MAX_BYTES = 65_000
GSO_MAX_SEGMENTS = 64
_ANCILLARY = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(4)

STATUS_OK, STATUS_PAYLOAD_CORRUPT, STATUS_MALFORMED = 0, 1, 2

# Tolerances of `compare`; docs/probes.md explains each.
LOSS_TOLERANCE = 0.015  # absolute, at LOSS_REFERENCE_PROBES probes; scales with 1/sqrt(n)
LOSS_REFERENCE_PROBES = 5000
DELAY_TOLERANCE = 0.05  # relative
JITTER_TOLERANCE = 0.20  # relative
RATE_TOLERANCE = 0.10  # relative
TIMING_FLOOR = 0.0005  # absolute allowance for delay and jitter: the path's own latency/noise
# In a User-Mode Linux guest one vCPU runs both ends of a train and the shaper, its timers are
# coarser and its system calls slower: 0.65 ms of spread was seen on a link without jitter
# while the host was loaded.
GUEST_TIMING_FLOOR = 0.002
Z = 4.0  # binomial tolerances: a correct link fails a check with probability ~6e-5
MIN_BURSTS = 20  # fewer loss bursts than this say nothing about their mean length


class ProbeError(RuntimeError):
    """A probe could not be run (bad namespace, address or size); the message says which."""


# ---------------------------------------------------------------------------------------------
# Wire format


def check_word(run: int, kind: int, seq: int, sent_ns: int) -> int:
    """The header's check word (also computed vectorised by `decode`)."""
    return (seq * _K_SEQ + sent_ns * _K_SENT + ((run << 8) | kind) * _K_ID) & _MASK64


def pad(run: int, length: int) -> bytes:
    """The payload after the header: pseudo-random bytes fixed by the run id."""
    return np.random.default_rng(run).integers(0, 256, length, dtype=np.uint8).tobytes()


def encode(run: int, seq: int, sent_ns: int, size: int, kind: int = KIND_PROBE) -> bytes:
    """One probe datagram of `size` bytes (the header plus the run's pad)."""
    if size < HEADER.size:
        raise ProbeError(f"size: a probe needs at least {HEADER.size} bytes, got {size}")
    header = HEADER.pack(
        MAGIC, VERSION, kind, 0, run, seq, sent_ns, check_word(run, kind, seq, sent_ns)
    )
    return header + pad(run, size - HEADER.size)


@dataclass(frozen=True)
class Decoded:
    """Per datagram: status (STATUS_*), kind, sequence number and send time (valid unless
    malformed)."""

    status: np.ndarray
    kind: np.ndarray
    seq: np.ndarray
    sent_ns: np.ndarray


def decode(slots: np.ndarray, lengths: np.ndarray, *, run: int, size: int) -> Decoded:
    """Classify received datagrams, vectorised; never raises on arbitrary bytes.

    `slots` is (n, width) uint8 holding the first `width` bytes of each datagram, `lengths` the
    datagrams' real lengths. A datagram is malformed unless it is exactly `size` bytes long and
    its header (magic, version, kind, run id, check word) is intact; its payload is then compared
    with the run's pad over the bytes kept.
    """
    n, width = slots.shape
    empty = np.zeros(n, dtype=np.int64)
    if width < HEADER.size:
        return Decoded(np.full(n, STATUS_MALFORMED, np.int8), empty, empty, empty)
    header = np.ascontiguousarray(slots[:, : HEADER.size]).view(HEADER_DTYPE).reshape(n)
    seq = header["seq"].astype(np.uint64)
    sent = header["sent_ns"].astype(np.uint64)
    kind = header["kind"].astype(np.uint64)
    ident = (np.uint64(run) << np.uint64(8)) | kind
    with np.errstate(over="ignore"):
        check = seq * np.uint64(_K_SEQ) + sent * np.uint64(_K_SENT) + ident * np.uint64(_K_ID)
    header_ok = (
        (np.asarray(lengths) == size)
        & (header["magic"] == MAGIC)
        & (header["version"] == VERSION)
        & (header["kind"] <= KIND_WARMUP)
        & (header["reserved"] == 0)
        & (header["run"] == run)
        & (header["check"] == check)
    )
    kept = min(width, size) - HEADER.size
    expected = np.frombuffer(pad(run, max(kept, 0)), dtype=np.uint8)
    payload_ok = np.all(slots[:, HEADER.size : HEADER.size + kept] == expected, axis=1)
    status = np.where(
        header_ok, np.where(payload_ok, STATUS_OK, STATUS_PAYLOAD_CORRUPT), STATUS_MALFORMED
    ).astype(np.int8)
    return Decoded(
        status,
        kind.astype(np.int64),
        seq.astype(np.int64),
        sent.view(np.int64),
    )


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
    send_stalls: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
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
    send_stalls: int = 0  # probes left out of the delay figures: descheduled while sending

    @property
    def frame_bytes(self) -> int:
        return self.size + FRAME_OVERHEAD


def summarize(train: Train) -> ProbeResult:
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
    # Arrivals whose send stalled carry a send time that says nothing about the link.
    timed = ~np.isin(seq, train.send_stalls)
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
        send_stalls=int(train.send_stalls.size),
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


def compare(configured: LinkProfile, result: ProbeResult,
            timing_floor: float = TIMING_FLOOR) -> list[Check]:
    """Every measured quantity beside what `configured` predicts, with a tolerance and a verdict.
    `timing_floor` (seconds) is the least allowance for delay and jitter: the path's own noise.

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
            *_delay_checks(configured, result, timing_floor),
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
    return checks


def _loss_check(configured: LinkProfile, result: ProbeResult) -> Check:
    """+-1.5 points at 5000 probes or more for independent losses (widened as 1/sqrt(n) below),
    plus Z standard errors of the extra variance that bursts add."""
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
    independent = LOSS_TOLERANCE**2 * LOSS_REFERENCE_PROBES / min(n, LOSS_REFERENCE_PROBES)
    tolerance = math.sqrt(independent + Z**2 * _burst_variance(configured) / n)
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


# ---------------------------------------------------------------------------------------------
# Sending and receiving


def _udp_socket(netns: str | None) -> socket.socket:
    """A UDP socket in `netns`; a namespace that cannot be entered is a ProbeError."""
    try:
        return udp_socket_in(netns)
    except NamespaceError as exc:
        raise ProbeError(str(exc)) from None


class _Receiver:
    """A bound UDP socket in the destination namespace that keeps the first `keep` bytes, the
    real length and the kernel arrival stamp of every datagram, in preallocated arrays."""

    def __init__(
        self,
        netns: str | None,
        address: str,
        *,
        run: int,
        size: int,
        keep: int,
        capacity: int,
    ) -> None:
        self.run, self.size, self.keep, self.capacity = run, size, keep, capacity
        self.sock = _udp_socket(netns)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            self.sock.bind((address, 0))
        except OSError as exc:
            self.sock.close()
            raise ProbeError(f"receiver on {address} in {netns}: {exc.strerror}") from None
        self.sock.setblocking(False)
        self.slots = np.zeros((capacity, keep), dtype=np.uint8)
        self.view = memoryview(self.slots).cast("B")
        self.lengths = np.zeros(capacity, dtype=np.int64)
        self.stamps = bytearray(16 * capacity)
        self.count = 0
        self.unread = 0
        self.drops = 0
        self.markers: dict[int, float] = {}  # kind -> monotonic time its first marker was read

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def drain(self) -> None:
        """Read every datagram queued now."""
        flags = socket.MSG_DONTWAIT | socket.MSG_TRUNC
        scratch = bytearray(self.keep)
        while True:
            n = self.count
            target = (
                self.view[n * self.keep : (n + 1) * self.keep] if n < self.capacity else scratch
            )
            try:
                length, ancillary, _, _ = self.sock.recvmsg_into([target], _ANCILLARY, flags)
            except BlockingIOError:
                return
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and n < self.capacity:
                    self.stamps[16 * n : 16 * n + 16] = data[:16]
                elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL:
                    self.drops = struct.unpack("I", data[:4])[0]
            if n >= self.capacity:
                self.unread += 1
                continue
            self.lengths[n] = length
            self.count = n + 1
            if length == self.size and target[5] != KIND_PROBE:
                self._marker(target)

    def _marker(self, data: memoryview | bytearray) -> None:
        """Note the first intact end or warm-up marker of each kind."""
        magic, version, kind, reserved, run, seq, sent, check = HEADER.unpack_from(data)
        if (
            (magic, version, reserved, run) == (MAGIC, VERSION, 0, self.run)
            and kind in (KIND_END, KIND_WARMUP)
            and check == check_word(run, kind, seq, sent)
        ):
            self.markers.setdefault(kind, time.monotonic())

    def wait(self, timeout: float) -> None:
        """Block until a datagram is queued or `timeout` passes, then drain."""
        if select.select([self.sock], [], [], max(timeout, 0))[0]:
            self.drain()

    def decoded(self) -> tuple[Decoded, np.ndarray]:
        """The datagrams read so far, decoded, and their arrival times (ns)."""
        n = self.count
        stamps = np.frombuffer(self.stamps, dtype=np.int64, count=2 * n).reshape(n, 2)
        recv_ns = stamps[:, 0] * 1_000_000_000 + stamps[:, 1]
        return decode(self.slots[:n], self.lengths[:n], run=self.run, size=self.size), recv_ns

    def linger(self) -> float:
        """How long to keep reading after the first end marker: probes sent before it may still
        be held by the link for up to (longest delay seen - the marker's delay)."""
        decoded, recv_ns = self.decoded()
        delays = (recv_ns - decoded.sent_ns) / 1e9
        ok = decoded.status != STATUS_MALFORMED
        ends, probes = ok & (decoded.kind == KIND_END), ok & (decoded.kind == KIND_PROBE)
        if not (ends.any() and probes.any()):
            return LINGER_MARGIN
        spread = float(delays[probes].max() - delays[ends][0])
        return 1.5 * max(spread, 0.0) + LINGER_MARGIN

    def close(self) -> None:
        self.sock.close()


class _Sender:
    """A UDP socket in the source namespace that writes probes into one reusable buffer."""

    def __init__(
        self,
        netns: str | None,
        destination: tuple[str, int],
        *,
        run: int,
        size: int,
        checksum: bool,
    ) -> None:
        self.sock = _udp_socket(netns)
        if not checksum:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        self.destination, self.run, self.size = destination, run, size
        self.buffer = bytearray(encode(run, 0, 0, size))

    def send(self, seq: int, kind: int = KIND_PROBE) -> int | None:
        """Send one probe; returns how long the send took after its stamp (ns), None on an
        error."""
        now = time.time_ns()
        HEADER.pack_into(
            self.buffer,
            0,
            MAGIC,
            VERSION,
            kind,
            0,
            self.run,
            seq,
            now,
            check_word(self.run, kind, seq, now),
        )
        try:
            self.sock.sendto(self.buffer, self.destination)
        except OSError:
            return None
        return time.time_ns() - now

    def close(self) -> None:
        self.sock.close()


def _check_address(address: str) -> str:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        raise ProbeError(f"address: expected an IPv4 address, got {address!r}") from None
    if parsed.version != 4:
        raise ProbeError(f"address: probes are IPv4 only, got {address!r}")
    return address


def _signal(receiver: _Receiver, sender: _Sender, kind: int, deadline: float) -> bool:
    """Send markers of `kind` every END_SPACING until one arrives or the deadline passes."""
    next_send = time.monotonic()
    while kind not in receiver.markers:
        now = time.monotonic()
        if now >= deadline:
            return False
        if now >= next_send:
            sender.send(0, kind)
            next_send = now + END_SPACING
        receiver.wait(min(next_send, deadline) - now)
    return True


def _finish(receiver: _Receiver, sender: _Sender, deadline: float) -> bool:
    """End the train: markers until one arrives, then read until the link can hold nothing
    more (or the deadline passes). Returns whether a marker arrived."""
    if not _signal(receiver, sender, KIND_END, deadline):
        return False
    stop = min(receiver.markers[KIND_END] + receiver.linger(), deadline)
    while (now := time.monotonic()) < stop:
        receiver.wait(stop - now)
    receiver.drain()
    return True


def run_train(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    count: int = DEFAULT_COUNT,
    interval: float = DEFAULT_INTERVAL,
    size: int = DEFAULT_SIZE,
    timeout: float = 5.0,
) -> Train:
    """Send `count` probes of `size` bytes every `interval` seconds from namespace `source` to
    `address` (a socket bound in `destination`), and collect what arrived.

    A warm-up marker opens the train (sent until one arrives, at most `timeout` seconds);
    end-of-train markers close it: the receiver stops once one arrived and the link can hold
    nothing more, or `timeout` seconds after the last probe was due.
    """
    _check_address(address)
    if count < 1:
        raise ProbeError(f"count: expected at least 1 probe, got {count}")
    if size < HEADER.size:
        raise ProbeError(f"size: a probe needs at least {HEADER.size} bytes, got {size}")
    run = secrets.randbits(32)
    receiver = _Receiver(
        destination, address, run=run, size=size, keep=size, capacity=2 * count + 1024
    )
    try:
        sender = _Sender(source, receiver.address, run=run, size=size, checksum=False)
        try:
            _signal(receiver, sender, KIND_WARMUP, time.monotonic() + timeout)
            errors: list[int] = []
            stalls: list[int] = []
            start = last = time.monotonic()
            seq = 0
            while seq < count:
                # A sender that fell behind catches up at twice its pace, never in one burst:
                # `compare` judges delays only where the nominal load is at most half a link's
                # rate, so even catching up the train never queues behind itself there.
                now = time.monotonic()
                due = max(start + seq * interval, last + interval / 2) if seq else start
                if now < due:
                    receiver.wait(due - now)
                    continue
                took = sender.send(seq)
                if took is None:
                    errors.append(seq)
                elif took > SEND_STALL * 1e9:
                    stalls.append(seq)
                seq += 1
                last = now
            spacing = (time.monotonic() - start) / max(count - 1, 1)
            ended = _finish(receiver, sender, time.monotonic() + timeout)
        finally:
            sender.close()
        decoded, recv_ns = receiver.decoded()
        probes = (decoded.status != STATUS_MALFORMED) & (decoded.kind == KIND_PROBE)
        return Train(
            sent=count,
            size=size,
            seq=decoded.seq[probes],
            sent_ns=decoded.sent_ns[probes],
            recv_ns=recv_ns[probes],
            payload_ok=decoded.status[probes] == STATUS_OK,
            malformed=int((decoded.status == STATUS_MALFORMED).sum()),
            send_errors=np.asarray(errors, dtype=np.int64),
            send_stalls=np.asarray(stalls, dtype=np.int64),
            receiver_drops=receiver.drops,
            unread=receiver.unread,
            ended=ended,
            interval=spacing,
        )
    finally:
        receiver.close()


@dataclass(frozen=True)
class RateResult:
    """A bulk train: bits per second of frames arriving, over how many frames of what size."""

    rate: float
    frames: int
    frame_bytes: int
    offered: float  # bits per second the sender achieved


def measure_rate(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    duration: float = 1.0,
    offered: float | None = None,
    timeout: float = 5.0,
) -> RateResult:
    """Push MTU-sized datagrams through the link for `duration` seconds and time their arrival.

    `offered` (bits/s of frames) paces the sender, e.g. 1.25x the rate under test, so the
    shaper's queue stays busy without flooding; None sends back to back. Datagrams leave in
    segmentation-offload batches (one send per ~44), which is what lets a UML guest exceed
    100 Mbit/s; the receiver keeps only headers.
    """
    _check_address(address)
    run = secrets.randbits(32)
    probe_sock = _udp_socket(source)
    try:
        probe_sock.connect((address, 9))
        mtu = probe_sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError as exc:
        raise ProbeError(f"no route to {address} from {source}: {exc.strerror}") from None
    finally:
        probe_sock.close()
    size = mtu - 28
    frame = size + FRAME_OVERHEAD
    batch = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // size))
    expected_frames = (offered or 10e9) * (duration + timeout) / (frame * 8)
    receiver = _Receiver(
        destination,
        address,
        run=run,
        size=size,
        keep=HEADER.size,
        capacity=int(min(expected_frames, 1_000_000)) + 1024,
    )
    try:
        sender = _Sender(source, receiver.address, run=run, size=size, checksum=True)
        try:
            sender.sock.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, size)
            sender.sock.connect(receiver.address)
            chunk = bytearray(bytes(sender.buffer) * batch)
            _signal(receiver, sender, KIND_WARMUP, time.monotonic() + timeout)
            seq = 0
            start = time.monotonic()
            while (now := time.monotonic()) < start + duration:
                if offered and seq * frame * 8 > offered * (now - start):
                    receiver.wait(seq * frame * 8 / offered - (now - start))
                    continue
                stamp = time.time_ns()
                for i in range(batch):
                    HEADER.pack_into(
                        chunk,
                        i * size,
                        MAGIC,
                        VERSION,
                        KIND_PROBE,
                        0,
                        run,
                        seq + i,
                        stamp,
                        check_word(run, KIND_PROBE, seq + i, stamp),
                    )
                with contextlib.suppress(OSError):  # ICMP errors, full queues: counted as not sent
                    sender.sock.send(chunk)
                    seq += batch
            elapsed = time.monotonic() - start
            _finish(receiver, sender, time.monotonic() + timeout)
        finally:
            sender.close()
        decoded, recv_ns = receiver.decoded()
        probes = (decoded.status == STATUS_OK) & (decoded.kind == KIND_PROBE)
        return RateResult(
            rate=bulk_rate(recv_ns[probes], frame),
            frames=int(probes.sum()),
            frame_bytes=frame,
            offered=seq * frame * 8 / elapsed,
        )
    finally:
        receiver.close()


def offered_load(profile: LinkProfile) -> float | None:
    """What a bulk train should offer to keep this profile's rate limiter busy: 1.25x its rate,
    more to make up for the loss netem applies before the limiter. None if no rate is set."""
    if profile.rate is None:
        return None
    return 1.25 * profile.rate / max(1 - profile.mean_loss, 0.05)


def probe(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    count: int = DEFAULT_COUNT,
    interval: float = DEFAULT_INTERVAL,
    size: int = DEFAULT_SIZE,
    rate_duration: float = 0.0,
    offered_rate: float | None = None,
    timeout: float = 5.0,
) -> ProbeResult:
    """Measure the link from namespace `source` to `address` in namespace `destination` (None:
    this process's namespace): a timed probe train, then, if `rate_duration` > 0, a bulk train
    for the rate."""
    result = summarize(
        run_train(
            source, destination, address, count=count, interval=interval, size=size, timeout=timeout
        )
    )
    if rate_duration <= 0:
        return result
    bulk = measure_rate(
        source, destination, address, duration=rate_duration, offered=offered_rate, timeout=timeout
    )
    return replace(
        result,
        rate=bulk.rate,
        rate_frames=bulk.frames,
        rate_frame_bytes=bulk.frame_bytes,
        rate_offered=bulk.offered,
    )
