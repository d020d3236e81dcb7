"""Reassembly: per opened (kind, step, bucket) key, each sender's chunks landed in its sink (or
kept, first copies only), what is still owed, and when chunks came; `Collected` is what a key
got by the time it was closed."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from testbed.transport.tensors import bits_dtype
from testbed.transport.udp.landing import Chunk, Sink, chunk_count
from testbed.transport.udp.replay import first_copies
from testbed.transport.wire import HEADER_SIZE, ITEMSIZE, Codec

# A sender's stream has ended once one of its last chunks came, its last quarter but at most
# TAIL of them: paced datagrams of one stream arrive in order, so what it still lacks then
# was lost, not in flight. (Of a stream of a few chunks only the last says so: its first says
# nothing of whether the others were sent yet.)
TAIL = 4

Key = tuple[int, int, int]  # (kind, step, bucket)


@dataclass
class ReceivedBatch:
    """Datagrams that passed the header checks: row i of `rows` holds datagram i from its
    header on, row i of `headers` its header (NATIVE_HEADER_DTYPE), `arrival` when each was
    read, `marked` whether it came marked CE (None: not known)."""

    rows: np.ndarray  # (k, stride) uint8
    headers: np.ndarray
    arrival: np.ndarray  # float64, time.monotonic()
    marked: np.ndarray | None = None  # bool

    def __getitem__(self, field: str) -> np.ndarray:
        return self.headers[field]

    def take(self, which: np.ndarray) -> ReceivedBatch:
        """The datagrams `which` picks (a bool mask or indexes), rows copied."""
        return ReceivedBatch(self.rows[which], self.headers[which], self.arrival[which],
                             None if self.marked is None else self.marked[which])

    def __len__(self) -> int:
        return len(self.headers)


@dataclass
class Collected:
    """What `collect` got for one key. `arrived`: per expected sender, a bool per chunk: it
    came in time (and fit its sink, if it had one). `chunks`: the first copy of each chunk of
    the senders that had no sink. How many datagrams of this kind came late for keys closed
    before (a deadline that was too short) since the key was opened, in all and per sender;
    when the last in-time chunk came (time.monotonic(); None if none did). Per sender that sent
    any in time: when its first and its last chunk of the key came; per sender none of whose
    chunks came but that was seen past its part of the key (it sent them: lost): when."""

    chunks: list[Chunk]
    arrived: dict[int, np.ndarray]
    late: int
    last_arrival: float | None
    late_from: dict[int, int] = dataclasses.field(default_factory=dict)
    first_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    last_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    reached: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def missing(self) -> set[tuple[int, int]]:
        """The expected (sender, index) pairs that did not come in time."""
        return {(sender, index) for sender, came in self.arrived.items()
                for index in np.flatnonzero(~came).tolist()}


class OpenKey:
    """An opened key: where each sender's chunks go, and what came so far."""

    def __init__(self, expected: Mapping[int, int], sinks: Mapping[int, Sink],
                 late_before: Counter[int], present: Mapping[int, np.ndarray]) -> None:
        self.arrived = {sender: np.zeros(count, dtype=bool) for sender, count in expected.items()}
        for sender, here in present.items():  # chunks in hand already: not owed
            self.arrived[sender] |= here
        # per sender, how many of its chunks have not come
        self.owed = {sender: count - int(self.arrived[sender].sum())
                     for sender, count in expected.items()}
        self.sinks = dict(sinks)
        self.chunks: dict[tuple[int, int], Chunk] = {}  # of senders without a sink
        self.first: dict[int, float] = {}  # per sender, when its first chunk of the key came
        self.last: dict[int, float] = {}  # per sender, when its latest chunk of the key came
        self.ended: set[int] = set()  # senders whose stream reached its tail
        self.shortened: set[int] = set()  # senders that sent their sink's short form
        # per sender without a chunk yet, when it was first seen past its part of the key:
        # it sent it, so what has not come was lost (or is still on its way)
        self.reached: dict[int, float] = {}
        self.newest: float | None = None  # when the newest chunk came
        self.late_before = late_before  # datagrams of this kind late per sender, when opened

    def limits(self, deadline: float, transfer: float | None, start_by: Mapping[int, float],
               now: float) -> dict[int, float]:
        """The senders that still owe chunks and are within their limit, with that limit
        (`DatagramEndpoint.collect` says what the limits are)."""
        limits = {}
        for sender, owed in self.owed.items():
            if owed <= 0:
                continue
            limit = deadline
            if transfer is not None:
                first = self.first.get(sender, self.reached.get(sender))
                limit = min(deadline, first + transfer if first is not None
                            else start_by.get(sender, deadline))
            if limit > now:
                limits[sender] = limit
        return limits

    def collected(self, kind: int, late: Mapping[tuple[int, int], int]) -> Collected:
        """What the key got; `late`: datagrams that came late, per (kind, sender), all along
        (those of the key's `kind` since it was opened count)."""
        late_from = {sender: count - self.late_before[sender]
                     for (kind_, sender), count in late.items()
                     if kind_ == kind and count > self.late_before[sender]}
        return Collected(
            chunks=list(self.chunks.values()),
            arrived=self.arrived,
            late=sum(late_from.values()),
            last_arrival=self.newest,
            late_from=late_from,
            first_arrivals=self.first,
            last_arrivals=self.last,
            reached=self.reached,
        )

    def deliver(self, sender: int, batch: ReceivedBatch, chunk_numel: Mapping[int, int]) -> None:
        """Take in a batch of this key's datagrams from `sender`: into its sink, or kept."""
        sink = self.sinks.get(sender)
        if sink is None:
            fit = np.ones(len(batch), dtype=bool)
            self._keep(sender, batch)
        else:
            fit = self._land(sender, sink, batch, chunk_numel[sink.codec])
            if not fit.all():
                batch = batch.take(fit)
        if not len(batch):
            return
        self.first.setdefault(sender, float(batch.arrival[0]))
        self.last[sender] = float(batch.arrival[-1])
        self.newest = max(self.newest or -math.inf, float(batch.arrival[-1]))
        chunks = batch["chunks"].astype(np.int64)
        if (chunks - batch["chunk"] <= np.clip(chunks // 4, 1, TAIL)).any():
            self.ended.add(sender)

    def _land(self, sender: int, sink: Sink, batch: ReceivedBatch, n: int) -> np.ndarray:
        """Hand the sink the new chunks that fit it; which datagrams fit. A stream of the
        sink's short form ends the sender's debt at its `short_count` chunks."""
        itemsize = ITEMSIZE[sink.codec]
        count, short = chunk_count(sink.numel, n), sink.short_count
        chunk, chunks = batch["chunk"], batch["chunks"]
        expected = np.where(chunk == count - 1, sink.numel - (count - 1) * n, n)
        counted = chunks == count
        arrived = self.arrived[sender]
        if short is not None and short < count:
            shortened = (chunks == short) & (chunk < short)
            if shortened.any() and sender not in self.shortened:
                self.shortened.add(sender)
                self.owed[sender] -= int((~arrived[short:]).sum())
            counted |= shortened
        fit = ((batch["codec"] == sink.codec) & counted
               & (batch["payload_len"] == expected * itemsize))
        index = chunk[fit].astype(np.int64)
        new = ~arrived[index] & first_copies(index)
        if new.any():
            rows = batch.rows[np.flatnonzero(fit)[new], HEADER_SIZE:HEADER_SIZE + n * itemsize]
            sink.land(index[new], rows.view(bits_dtype(itemsize)))
            arrived[index[new]] = True
            self.owed[sender] -= int(new.sum())
        return fit

    def _keep(self, sender: int, batch: ReceivedBatch) -> None:
        """Keep the first copy of each chunk of a sender without a sink (tests, small keys)."""
        arrived = self.arrived.get(sender)
        for row, index, count, codec, size, arrival in zip(
            batch.rows, batch["chunk"].tolist(), batch["chunks"].tolist(),
            batch["codec"].tolist(), batch["payload_len"].tolist(), batch.arrival.tolist(),
            strict=True,
        ):
            if (sender, index) in self.chunks:
                continue
            payload = memoryview(bytearray(row[HEADER_SIZE:HEADER_SIZE + size]))
            self.chunks[sender, index] = Chunk(sender, index, count, Codec(codec), payload, arrival)
            if arrived is not None and index < len(arrived):
                arrived[index] = True
                self.owed[sender] -= 1

