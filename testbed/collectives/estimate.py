"""The numerics of the lossy all-reduce (after Weintraub, Banner and Orda).

A shard owner receives each peer's slice of its shard as chunks (one datagram each); whatever
did not arrive by the deadline is missing. Per chunk it averages the contributions that did
arrive (its own always does). Which datagrams are lost does not depend on their values, so for
gradients drawn independently around the true gradient this mean is an unbiased estimate of it,
with a variance that grows only as fewer peers contribute.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch


class ChunkAccumulator:
    """Running per-chunk sums and contribution counts of one shard; no per-peer copies kept."""

    def __init__(self, numel: int, chunk_numel: int, dtype: torch.dtype = torch.float32) -> None:
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel: needs at least 1, got {chunk_numel}")
        self.numel = numel
        self.chunk_numel = chunk_numel
        self.chunks = max(1, math.ceil(numel / chunk_numel))
        if dtype not in (torch.float16, torch.float32, torch.float64):
            raise ValueError(f"dtype: sums are kept in float16, float32 or float64, not {dtype}")
        self.total = torch.zeros(numel, dtype=dtype)
        self.weight = torch.zeros(self.chunks, dtype=torch.float64)
        # numpy views of both, for `add_chunks`
        self._sums, self._weights = self.total.numpy(), self.weight.numpy()
        self._whole = numel // chunk_numel  # chunks of full length; one shorter may follow
        self._grid = self._sums[:self._whole * chunk_numel].reshape(self._whole, chunk_numel)

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_numel
        return start, min(start + self.chunk_numel, self.numel)

    def add_chunk(self, chunk: int, values: torch.Tensor, weight: float = 1.0) -> None:
        """Add one received chunk; `weight` is e.g. the micro-batches behind it (DropCompute)."""
        start, end = self.bounds(chunk)
        if values.numel() != end - start:
            raise ValueError(f"chunk {chunk}: expected {end - start} values, got {values.numel()}")
        self.total[start:end].add_(values, alpha=weight)
        self.weight[chunk] += weight

    def add_all(self, values: torch.Tensor, weight: float = 1.0) -> None:
        """Add a whole contribution at once (the owner's own, which never travels)."""
        self.total.add_(values, alpha=weight)
        self.weight += weight

    def add_chunks(self, index: np.ndarray, values: np.ndarray) -> None:
        """Add received chunks at once, as they come off the wire: chunks `index` (distinct),
        row i of `values` ((k, chunk_numel), numbers of any type) holding chunk index[i]; the
        last chunk's row counts only as far as the shard goes. No copy of a contribution is
        kept, only the sums. numpy, not torch: a torch op on a batch this small may be spread
        over torch's threads, which costs more than the adding (index_add_ with two threads:
        milliseconds for 64 rows)."""
        whole, split = self._whole, self._whole * self.chunk_numel
        if index.max() < whole:  # all of full length: the common case
            self._grid[index] += values
        else:
            full = index < whole
            self._grid[index[full]] += values[full]
            self._sums[split:] += values[~full][0, :self.numel - split]
        self._weights[index] += 1

    def coverage(self) -> torch.Tensor:
        """Total weight that arrived per chunk."""
        return self.weight.clone()

    def mean(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-chunk weighted mean of what arrived; chunks nobody sent stay zero. Into `out`
        (contiguous, `numel` long; it may be `total` itself) or a new tensor."""
        out = torch.empty_like(self.total) if out is None else out
        return divide_by_chunk(self.total, self.weight.clamp_min(1e-12), self.chunk_numel, out)


def divide_by_chunk(values: torch.Tensor, divisor: torch.Tensor, chunk_numel: int,
                    out: torch.Tensor) -> torch.Tensor:
    """`values` (flat, contiguous) divided chunk by chunk: element i by divisor[i //
    chunk_numel], into `out` (may be `values` itself), without a per-element divisor."""
    divisor = divisor.to(values.dtype)
    numel = values.numel()
    whole = numel // chunk_numel  # chunks of full length; one shorter may follow
    split = whole * chunk_numel
    torch.div(values[:split].view(whole, chunk_numel), divisor[:whole, None],
              out=out[:split].view(whole, chunk_numel))
    if split < numel:
        torch.div(values[split:], divisor[whole], out=out[split:])
    return out


@dataclass
class AdaptiveDeadline:
    """How long an owner waits for chunks, learned from when the last chunk arrived recently.

    Lost chunks never arrive, so the observed signal is the arrival time of the last chunk that
    did; the deadline is a high quantile of recent ones times a margin, within [floor, ceiling].
    Until `trust` calls were seen it is never below `initial`: a quantile of a handful of calls
    on a busy host says little, and one learned too short cuts off whole senders. A step that
    has everything in hand ends at once, whatever the deadline.
    """

    floor: float = 0.005
    ceiling: float = 5.0
    initial: float = 1.0
    quantile: float = 0.9
    margin: float = 1.5
    window: int = 32
    trust: int = 8
    history: deque[float] = field(default_factory=deque, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.initial <= self.ceiling:
            raise ValueError("deadline: needs 0 < floor <= initial <= ceiling")
        self.history = deque(maxlen=self.window)

    @property
    def seconds(self) -> float:
        if not self.history:
            return self.initial
        ordered = sorted(self.history)
        value = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))] * self.margin
        if len(ordered) < self.trust:
            value = max(value, self.initial)
        return min(self.ceiling, max(self.floor, value))

    def observe(self, last_arrival: float, late_chunks: int = 0) -> None:
        """Record a step: when its last in-time chunk came, and how many came after the deadline.

        Lost chunks do not move the deadline (they never come); late ones mean it was too short,
        so such a step is recorded as the deadline raised by the margin.
        """
        late = max(last_arrival, self.seconds * self.margin)
        self.history.append(late if late_chunks else last_arrival)


@dataclass
class AdaptiveSettle:
    """How long a phase waits in quiet once every sender's stream ended, before it takes
    what is missing for lost (`collect(settle=)`), learned from what came late. A chunk that
    comes after its phase closed was not lost but cut off: a call that saw such late
    datagrams doubles the wait (up to `ceiling`, where it starts); each call without shortens
    it by `shrink` (down to `floor`). On links that keep a stream in order nothing is late,
    and the wait falls to the floor: under loss a phase then ends about as soon as its data
    stops coming."""

    floor: float = 0.001
    ceiling: float = 0.01
    shrink: float = 0.8
    seconds: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.ceiling or not 0 < self.shrink < 1:
            raise ValueError("settle: needs 0 < floor <= ceiling and 0 < shrink < 1")
        self.seconds = self.ceiling

    def observe(self, late_chunks: int) -> None:
        """Record a call: how many of this phase's datagrams came after their call closed."""
        if late_chunks:
            self.seconds = min(self.ceiling, 2 * self.seconds)
        else:
            self.seconds = max(self.floor, self.shrink * self.seconds)
