"""What a probe train says about a link: its statistics.

Pure and vectorised: `analyze` turns what a train delivered (`Train`) into loss and its
bursts, one-way delay, reordering, duplication, corruption and the bunches a link delivers
(`ProbeResult`). `netem.probe.verdicts` sets them beside what a `LinkProfile` predicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from netem.probe.wire import FRAME_OVERHEAD

PERCENTILES = (10, 50, 90, 99)  # of the one-way delay
# A probe held up by a stall of the sender (in a guest: of its whole kernel, netem's timers
# included) was stamped within this long before or during the stall, or its delivery fell due
# during it and it arrived within this long after the stall ended.
STALL_MARGIN = 0.001
# Delay and jitter are judged on the probes no stall held up, when there are at least this many
# of them (or half the arrivals of a shorter train): the relative standard error of the jitter
# is then at most 1/sqrt(2 * 300) = 4.1%, under a fifth of its tolerance (a correct link fails
# it by chance with probability about 1e-6). In the guest with a core kept busy, stalls held up
# 43-62% of a train's 2000 probes (benchmarks/results/probe-stalls.md).
MIN_TIMED = 300


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


def arrival_bunches(sent_ns: np.ndarray, recv_ns: np.ndarray,
                    interval: float) -> tuple[int, float]:
    """The runs of arrivals less than half the send `interval` apart (a link that holds packets
    and lets them go together, as netem's slots do, delivers such bunches), and how long the
    first-sent probe of each run waited for it on average: from its send to the run's first
    arrival, seconds (NaN without arrivals). On a slotted link that probe found the link idle
    and started the slot: it waited a whole slot gap, however the sender was paced."""
    order = np.argsort(recv_ns, kind="stable")
    sent, recv = np.asarray(sent_ns)[order], np.asarray(recv_ns)[order]
    if not recv.size:
        return 0, math.nan
    starts = np.flatnonzero(np.concatenate(([True], np.diff(recv) >= interval / 2 * 1e9)))
    waits = recv[starts] - np.minimum.reduceat(sent, starts)
    return int(starts.size), float(waits.mean() / 1e9)


@dataclass(frozen=True)
class Train:
    """What one train delivered, before any statistics.

    `seq`, `sent_ns` and `recv_ns` describe every arrival whose header was intact, in arrival
    order (duplicates included); `payload_ok` says whether its payload was too, `marked`
    whether it arrived marked CE (of a train sent `ecn_capable`).
    """

    sent: int
    size: int
    seq: np.ndarray
    sent_ns: np.ndarray
    recv_ns: np.ndarray
    payload_ok: np.ndarray
    marked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    ecn_capable: bool = False
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
    delay_percentiles: dict[int, float]  # PERCENTILES: 10, 50, 90, 99
    reorder_ratio: float  # arrived after a higher sequence number (RFC 4737)
    overtake_ratio: float  # arrived before a lower sequence number
    duplicate_ratio: float
    corrupt_ratio: float
    size: int  # UDP payload of a probe, bytes
    interval: float  # mean spacing of the sends
    send_errors: int
    receiver_drops: int  # datagrams the receiving socket itself dropped (buffer full)
    ended: bool  # an end-of-train marker arrived (else the receiver timed out)
    bunches: int  # runs of arrivals less than half the send interval apart (`arrival_bunches`)
    bunch_wait: float  # mean time a bunch's first-sent probe waited for it to arrive, seconds
    rate: float | None = None  # from the bulk train
    rate_frames: int = 0
    rate_frame_bytes: int = 0
    rate_offered: float | None = None  # what the bulk train's sender achieved, bits/s
    stalled: int = 0  # arrivals left out of the delay figures: held up by a stall of the sender
    trains: int = 1  # timed trains sent: the ones before the last found the host too busy
    ecn_capable: bool = False  # the probes were sent ECT(0): a link with `ecn` marks them
    marked: int = 0  # distinct probes that arrived marked CE
    marked_ratio: float = 0.0  # of the probes sent: what such a link would have dropped

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
    marked = (np.asarray(train.marked, dtype=bool) if len(train.marked)
              else np.zeros(train.seq.size, dtype=bool))
    seq, sent_ns, recv_ns, payload_ok, marked = (
        seq[in_range],
        train.sent_ns[in_range],
        train.recv_ns[in_range],
        np.asarray(train.payload_ok, dtype=bool)[in_range],
        marked[in_range],
    )
    first = first_arrivals(seq)
    received = int(first.sum())
    marked_count = int((marked & first).sum())
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
    bunches, bunch_wait = arrival_bunches(sent_ns, recv_ns, train.interval)
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
                PERCENTILES,
                np.percentile(delay, PERCENTILES) if delay.size else [math.nan] * len(PERCENTILES),
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
        bunches=bunches,
        bunch_wait=bunch_wait,
        stalled=int((~timed).sum()),
        ecn_capable=train.ecn_capable,
        marked=marked_count,
        marked_ratio=_ratio(marked_count, attempted) if attempted else 0.0,
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
