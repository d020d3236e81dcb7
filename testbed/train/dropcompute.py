"""DropCompute (Giladi et al.): stop computing micro-batches once a time threshold passes.

A worker accumulates gradients over micro-batches; micro-batch m is computed only if the
worker's compute time when it would start (real compute plus injected delay so far) is below
the threshold tau, so the first one always is. The step's gradient must then be the mean over
every micro-batch computed anywhere, not the mean of the workers' means: workers send the
*sum* of their micro-batch gradients with the *count* appended, and the average of those
payloads over W workers gives

    (sum_i S_i / W) / (sum_i c_i / W) = sum_i S_i / sum_i c_i,

exactly the micro-batch-weighted mean, from one ordinary all-reduce (see `pack`/`unpack`).

`threshold: auto` picks tau from the first `warmup_steps` steps (computed in full): every
worker contributes the start times of all its micro-batches, and tau is the smallest value
at which the fraction of start times >= tau, i.e. of micro-batches that would have been
dropped, is at most `target_drop_rate`. The times are pooled over all workers so that a
worker that is always slow drops more, which is the point, instead of getting its own laxer
threshold.
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


def auto_threshold(start_times: np.ndarray, target_drop_rate: float) -> float:
    """The smallest tau dropping at most `target_drop_rate` of the micro-batches whose
    start times (seconds into their step's compute) are given; inf if none may be dropped."""
    starts = np.sort(np.asarray(start_times, dtype=np.float64).ravel())
    dropped = math.floor(target_drop_rate * starts.size)
    if not 0 < dropped < starts.size:
        return math.inf
    # Every start above the last one that must be kept; past ties, so equal times stay together.
    first_dropped = np.searchsorted(starts, starts[starts.size - dropped - 1], side="right")
    return float(starts[first_dropped]) if first_dropped < starts.size else math.inf


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
        """Record a full step's micro-batch start times; after warm-up, calibrate tau.

        Calibration gathers every worker's recent times through the collective (each worker
        writes its own slot of a zero vector, so the average times `world` is all of them). It
        is retried on later steps while the collective reports the exchange incomplete.
        """
        if self.threshold is not None:
            return
        self._starts.extend(start_times)
        if len(self._starts) < (self._starts.maxlen or 0):
            return
        slots = torch.zeros(self.world, len(self._starts))
        slots[self.rank] = torch.tensor(list(self._starts))
        mean, stats = collective.allreduce(slots.flatten(), step)
        if stats.coverage < 1.0 or stats.peers_missing:
            return
        self.threshold = auto_threshold((mean * self.world).numpy(), self.spec.target_drop_rate)
