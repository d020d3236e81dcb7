"""Where a lossy call's chunks land as they are read, and which of them count: a phase's key is
opened with a sink per sender before its first datagram goes out, and a test loss model may
discard some chunks before they reach it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from testbed.collectives.estimate import ChunkAccumulator
from testbed.transport.tensors import codec_of, values_of
from testbed.transport.udp import DatagramEndpoint, Landing, Sink, chunk_count
from testbed.transport.wire import Codec, Kind


@dataclass(frozen=True)
class SeededLoss:
    """A deterministic test loss model, for unit tests of the numerics only: the receiver
    discards the chunks that a generator seeded by (seed, kind, step, bucket, sender, receiver)
    picks, each with probability `rate`, after the transport delivered them. Real runs lose
    packets on shaped links instead, and never use this."""

    rate: float
    seed: int = 0
    kinds: frozenset[Kind] = frozenset({Kind.GRADIENT, Kind.PARAMETER})

    def lost(
        self, kind: Kind, step: int, bucket: int, sender: int, receiver: int, chunks: int
    ) -> np.ndarray:
        """Which of the `chunks` chunks of one sender's tensor are discarded (a bool each)."""
        if kind not in self.kinds:
            return np.zeros(chunks, dtype=bool)
        seed = [self.seed, int(kind), step, bucket, sender, receiver]
        return np.random.default_rng(seed).random(chunks) < self.rate


def open_key(
    endpoint: DatagramEndpoint, kind: Kind, step: int, bucket: int,
    sinks: Mapping[int, Sink | torch.Tensor], *, receiver: int, test_loss: SeededLoss | None,
    present: Mapping[int, np.ndarray] | None = None,
) -> dict[int, np.ndarray]:
    """Open (kind, step, bucket) at `endpoint` (rank `receiver`'s) with a sink per sender
    (`present`: the chunks in hand already, see `DatagramEndpoint.open`); per sender, which of
    its chunks count (all, but for those `test_loss` discards: they never reach the sink)."""
    sinks = {sender: Landing([sink], endpoint.chunk_numel(codec_of(sink.dtype)))
             if isinstance(sink, torch.Tensor) else sink for sender, sink in sinks.items()}
    keep = {}
    for sender, sink in sinks.items():
        count = chunk_count(sink.numel, endpoint.chunk_numel(sink.codec))
        keep[sender] = np.ones(count, dtype=bool)
        if test_loss is not None:
            keep[sender] &= ~test_loss.lost(kind, step, bucket, sender, receiver, count)
    endpoint.open(kind, step, bucket, {sender: len(k) for sender, k in keep.items()},
                  into={sender: _Kept(sink, keep[sender]) if not keep[sender].all()
                        else sink for sender, sink in sinks.items()}, present=present)
    return keep


class Accumulating:
    """A sink of the gather: a peer's chunks (of `codec`) of this owner's shard are added into
    the accumulator as they are read; no per-peer copy is kept."""

    def __init__(self, accumulator: ChunkAccumulator, codec: Codec) -> None:
        self.accumulator, self.codec = accumulator, codec
        self.numel = accumulator.numel
        self.short_count = None

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        self.accumulator.add_chunks(index, values_of(payload, self.codec))


class _Kept:
    """A sink that passes on only the chunks `keep` marks: what a test loss model did not
    discard."""

    def __init__(self, sink: Sink, keep: np.ndarray) -> None:
        self.sink, self.keep = sink, keep
        self.codec, self.numel, self.short_count = sink.codec, sink.numel, sink.short_count

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        kept = self.keep[index]
        if kept.any():
            self.sink.land(index[kept], payload[kept])
