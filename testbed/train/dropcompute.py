"""DropCompute (Giladi et al.): stop computing micro-batches once a time threshold passes.

A worker accumulates gradients over micro-batches; micro-batch m is computed only if the
worker's compute time when it would start (real compute plus injected delay so far) is below
the threshold tau, so the first one always is. The step's gradient must then be the mean over
every micro-batch computed anywhere, not the mean of the workers' means: workers send the
*sum* of their micro-batch gradients with the *count* appended, and the average of those
payloads over W workers gives

    (sum_i S_i / W) / (sum_i c_i / W) = sum_i S_i / sum_i c_i,

exactly the micro-batch-weighted mean, from one ordinary all-reduce (see `pack`/`unpack`).

`threshold: auto` picks tau from the first `warmup_steps` steps (computed in full): tau is the
smallest value at which the fraction of micro-batch start times >= tau, i.e. of micro-batches
that would have been dropped, is at most `target_drop_rate`. The times are pooled over all
workers so that a worker that is always slow drops more, which is the point, instead of getting
its own laxer threshold. They are pooled as a histogram on fixed log-spaced bins, averaged by
one ordinary all-reduce: every worker makes exactly that one call whatever the network does
(no retry that only some workers would make), and a lossy all-reduce's estimate of the mean
histogram is as good as any for a quantile. tau is a bin edge, so it is exact to a bin's
width (1.6%).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from testbed.collectives.base import Collective
    from testbed.train.config import DropComputeSpec


def pack(gradient_sum: torch.Tensor, count: int) -> torch.Tensor:
    """The all-reduce payload: this worker's summed micro-batch gradients, then their count."""
    return torch.cat([gradient_sum, gradient_sum.new_tensor([float(count)])])


def unpack(mean_payload: torch.Tensor) -> torch.Tensor:
    """The micro-batch-weighted mean gradient from the averaged payloads."""
    return mean_payload[:-1] / mean_payload[-1]


# Bin i holds start times in [BIN_EDGES[i], BIN_EDGES[i + 1]); the last is open-ended.
BIN_EDGES = np.concatenate([[0.0], np.geomspace(1e-4, 1e3, 1023)])


def start_histogram(start_times: np.ndarray | list[float]) -> np.ndarray:
    """Counts of micro-batch start times (seconds into their step's compute) per bin."""
    starts = np.asarray(start_times, dtype=np.float64).ravel()
    index = np.searchsorted(BIN_EDGES, np.maximum(starts, 0.0), side="right") - 1
    return np.bincount(index, minlength=BIN_EDGES.size).astype(np.float64)


def auto_threshold(histogram: np.ndarray, target_drop_rate: float) -> float:
    """The smallest bin edge tau dropping at most `target_drop_rate` of the start times that
    `histogram` counts (a worker's, or the workers' mean); inf if none may be dropped."""
    counts = np.clip(np.asarray(histogram, dtype=np.float64), 0.0, None)
    total = counts.sum()
    if total <= 0:
        return math.inf
    tail = np.cumsum(counts[::-1])[::-1] / total  # tail[b]: the fraction starting in bin b or later
    fits = np.flatnonzero(tail[1:] <= target_drop_rate + 1e-12) + 1
    if not fits.size or tail[fits[0]] == 0:
        return math.inf
    return float(BIN_EDGES[fits[0]])


class DropCompute:
    """One worker's threshold: fixed, or calibrated once from all workers' warm-up steps."""

    def __init__(self, spec: DropComputeSpec, micro_batches: int, rank: int, world: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world = world
        self.threshold: float | None = None if spec.threshold == "auto" else spec.threshold
        self._starts: deque[float] = deque(maxlen=spec.warmup_steps * micro_batches)

    def stop(self, elapsed: float) -> bool:
        """Whether a worker `elapsed` seconds into its compute should start no more work."""
        return self.threshold is not None and elapsed >= self.threshold

    def observe(self, start_times: list[float], step: int, collective: Collective) -> None:
        """Record a full step's micro-batch start times; after warm-up, calibrate tau once
        from the workers' mean histogram of them (one all-reduce, on every worker at the same
        step: before calibration every step is computed in full)."""
        if self.threshold is not None:
            return
        self._starts.extend(start_times)
        if len(self._starts) < (self._starts.maxlen or 0):
            return
        mine = torch.from_numpy(start_histogram(list(self._starts))).float()
        mean, _ = collective.allreduce(mine, step)
        self.threshold = auto_threshold(mean.double().numpy(), self.spec.target_drop_rate)
