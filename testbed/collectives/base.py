"""The one contract every collective keeps, so jobs, benchmarks and DDP hooks can swap them.

`allreduce(tensor, step)` returns this worker's view of the average of `tensor` over the
workers, and what it cost. A collective may be inexact by design (lossy: chunks that missed the
deadline; moshpit: peers left out of a group): its stats say how inexact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class AllReduceStats:
    """What one all-reduce did. `coverage` is the fraction of (peer, element) contributions that
    made it into the result (1.0 for exact collectives); `extra` holds collective-specific
    figures with Prometheus-friendly names (e.g. `deadline_seconds`, `late_chunks`)."""

    collective: str
    step: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    coverage: float = 1.0
    peers_missing: tuple[int, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Collective(Protocol):
    """An all-reduce among `world` workers; this object is worker `rank`'s end of it."""

    name: str
    rank: int
    world: int

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        """The average of `tensor` over the workers (a new tensor; the input is not modified)."""
        ...

    def close(self) -> None:
        """Release sockets and threads; idempotent."""
        ...
