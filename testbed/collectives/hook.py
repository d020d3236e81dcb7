"""Any collective as a PyTorch DDP communication hook, so a user's own DDP model trains over it.

    model = DistributedDataParallel(net, process_group=group)
    model.register_comm_hook(state=None, hook=comm_hook(create("ring", rank, world, ...)))

DDP still needs its own process group (gloo) for its bookkeeping (broadcasting the initial
parameters, bucket rebuilds); the gradients themselves go through the collective.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from testbed.collectives.base import AllReduceStats, Collective

# No `from __future__ import annotations` in this module: DDP checks the hook's annotations
# against the GradBucket and Future[Tensor] objects themselves, not their names.
Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def comm_hook(
    collective: Collective, on_stats: Callable[[AllReduceStats], None] | None = None
) -> Hook:
    """A DDP hook that averages each gradient bucket through `collective`; `on_stats` sees what
    each all-reduce cost. Calls are numbered so buckets of one backward pass stay apart."""
    calls = 0

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        nonlocal calls
        averaged, stats = collective.allreduce(bucket.buffer(), step=calls)
        calls += 1
        if on_stats is not None:
            on_stats(stats)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(averaged)
        return future

    return hook
