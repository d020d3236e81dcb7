"""Sequence numbers: every (sender incarnation, destination) stream numbers its datagrams from
0, so a datagram already seen, or older than the replay window, is a replay (dropped), and gaps
are datagrams lost on the way, whatever took them. A restarted sender is a new incarnation: it
retires the stream before it, and recordings of retired incarnations stay replays."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

JOINED_LATE = 64  # a stream first seen at this sequence number or beyond was joined late


def increasing(values: np.ndarray) -> bool:
    """Each value above the one before it: a stream's run in order, the common case."""
    return len(values) < 2 or bool((values[1:] > values[:-1]).all())


def first_copies(values: np.ndarray) -> np.ndarray:
    """A bool per element: no element before it has its value."""
    if increasing(values):
        return np.ones(len(values), dtype=bool)
    first = np.zeros(len(values), dtype=bool)
    first[np.unique(values, return_index=True)[1]] = True
    return first


class SenderStream:
    """The sequence numbers one sender incarnation's stream delivered: the highest, and which
    of the `window` up to it came (a ring: number s in slot s % window). Anything already seen
    or older than the window is a replay. `step`: the furthest step it delivered."""

    __slots__ = ("base", "highest", "incarnation", "received", "ring", "step", "window")

    def __init__(self, incarnation: int, first: int, window: int, step: int) -> None:
        self.incarnation = incarnation
        self.window = window
        self.step = step
        # Streams start at 0; one first seen at JOINED_LATE or beyond was joined late (this
        # endpoint restarted while its peers went on), and counting from 0 would call everything
        # before it lost. (A fresh stream whose first JOINED_LATE datagrams were all lost is
        # counted from its first arrival instead: at most that many uncounted.)
        self.base = first if first >= JOINED_LATE else 0
        self.highest = first  # the first datagram, which made the stream, is received
        self.ring = np.zeros(window, dtype=bool)
        self.ring[first % window] = True
        self.received = 1

    def accept(self, seqs: np.ndarray) -> np.ndarray:
        """Which of `seqs` (uint64, in arrival order) are new; the stream takes them in."""
        window, highest = self.window, np.uint64(self.highest)
        if seqs[0] > highest and increasing(seqs):  # a run beyond everything seen
            took = np.ones(len(seqs), dtype=bool)
        else:
            before = np.empty_like(seqs)  # the highest seen before each one
            before[0] = highest
            before[1:] = seqs[:-1]
            np.maximum.accumulate(before, out=before)
            new = seqs > before
            # below the highest: new only within the window, from the stream's start on, not
            # seen before this batch (in the ring), and not earlier in it
            below = ~new & (before - seqs < window) & (seqs >= self.base) & first_copies(seqs)
            below[below] = ~((seqs[below] <= highest) & self.ring[seqs[below] % window])
            took = new | below
        top = max(self.highest, int(seqs.max()))
        advance = top - self.highest
        if advance >= window:
            self.ring[:] = False
        elif advance:
            start = (self.highest + 1) % window
            self.ring[start:start + advance] = False
            self.ring[:max(0, start + advance - window)] = False
        self.ring[seqs[took & (np.uint64(top) - seqs < window)] % window] = True
        self.highest = top
        self.received += int(took.sum())
        return took

    @property
    def lost(self) -> int:
        return self.highest + 1 - self.base - self.received


class StreamTable:
    """Per sender, the stream of its live incarnation, the incarnations it retired, and what
    the streams of those lost."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._streams: dict[int, SenderStream] = {}
        self._retired: dict[int, set[int]] = defaultdict(set)
        self._lost_before: Counter[int] = Counter()

    def accept(self, sender: int, incarnations: np.ndarray, seqs: np.ndarray,
               steps: np.ndarray) -> np.ndarray:
        """Which of `sender`'s datagrams (their header fields, in arrival order) are new; the
        streams take them in."""
        took = np.zeros(len(seqs), dtype=bool)
        # runs of one incarnation, in order: a new one retires the stream before it
        runs = np.flatnonzero(incarnations[1:] != incarnations[:-1]) + 1
        for first, end in zip([0, *runs.tolist()], [*runs.tolist(), len(seqs)], strict=True):
            stream, start = self._streams.get(sender), first
            incarnation = int(incarnations[start])
            if stream is None or stream.incarnation != incarnation:
                if incarnation in self._retired[sender]:
                    continue
                if stream is not None:
                    # A restarted sender goes on from the live step: datagrams of an unknown
                    # incarnation whose step is behind the stream's are a recording of an
                    # earlier one, replayed (with the run's key they still carry a valid MAC),
                    # and retire nothing; the first that is not behind starts the new stream.
                    behind = steps[start:end] < stream.step
                    if behind.all():
                        continue
                    start += int(behind.argmin())
                    self._retired[sender].add(stream.incarnation)
                    self._lost_before[sender] += stream.lost
                stream = self._streams[sender] = SenderStream(incarnation, int(seqs[start]),
                                                              self.window, int(steps[start]))
                took[start] = True
                start += 1
            if start < end:
                took[start:end] = stream.accept(seqs[start:end])
            if took[first:end].any():
                stream.step = max(stream.step, int(steps[first:end][took[first:end]].max()))
        return took

    def lost(self, sender: int) -> int:
        """Datagrams of `sender`'s streams, retired ones included, that never came."""
        stream = self._streams.get(sender)
        return self._lost_before[sender] + (stream.lost if stream else 0)
