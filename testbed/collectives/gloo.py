"""torch.distributed's gloo all-reduce: the production baseline the testbed's collectives race.

torch.distributed keeps one default process group per process, so a process holds at most one
`Gloo`; tests run each worker in its own process, never in threads.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from testbed.collectives.base import AllReduceStats


class Gloo:
    """Worker `rank`'s end of a gloo group that meets at `master` (rank 0's TCP store)."""

    name = "gloo"

    def __init__(
        self, rank: int, world: int, *, master: tuple[str, int], timeout: float = 60.0
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("gloo: this process already has a torch.distributed group")
        self.rank, self.world = rank, world
        host, port = master
        dist.init_process_group(
            "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout),
        )

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        started = time.monotonic()
        result = tensor.detach().clone()
        dist.all_reduce(result)
        result.div_(self.world)
        return result, AllReduceStats(self.name, step, seconds=time.monotonic() - started)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
