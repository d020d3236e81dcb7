"""Any collective as a PyTorch DDP communication hook, so a user's own DDP model trains over it.

    model = DistributedDataParallel(net, process_group=group)
    model.register_comm_hook(state=None, hook=comm_hook(create("ring", rank, world, ...)))

DDP still needs its own process group (gloo) for its bookkeeping (broadcasting the initial
parameters, bucket rebuilds); the gradients themselves go through the collective.

The hook is asynchronous, as DDP's own all-reduce is: it hands the bucket to the collective on a
thread of its own and returns a future at once, so the backward pass goes on computing the next
buckets while this one travels; DDP waits for the futures at the end of the backward pass. The
collective's calls keep the order DDP made them in (one thread, a queue), and each call is
numbered so buckets of one backward pass stay apart. On a CUDA model the future holds the
result on the bucket's device; the copies to the host and back run on a stream of the hook's
call (`staging.Handover`), beside the backward pass's kernels.
"""

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from testbed.collectives.base import AllReduceStats, Collective
from testbed.transport.staging import Handover

# No `from __future__ import annotations` in this module: DDP checks the hook's annotations
# against the GradBucket and Future[Tensor] objects themselves, not their names.
Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class _Calls:
    """The collective's calls on one thread, in order; `started` notes when each began."""

    def __init__(self, collective: Collective,
                 on_stats: Callable[[AllReduceStats], None] | None) -> None:
        self.collective, self.on_stats = collective, on_stats
        self.number = 0
        self.started: list[int] = []  # call numbers, in the order the thread began them
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"comm-hook-{collective.rank}")

    def submit(self, bucket: torch.Tensor) -> torch.futures.Future:
        handover = Handover(bucket)
        future = handover.future()
        with self._lock:
            number = self.number
            self.number += 1
        self._thread.submit(self._run, number, handover, future)
        return future

    def _run(self, number: int, handover: Handover, future: torch.futures.Future) -> None:
        self.started.append(number)
        try:
            with handover.received() as bucket:
                averaged, stats = self.collective.allreduce(bucket, step=number)
                if self.on_stats is not None:
                    self.on_stats(stats)
                future.set_result(averaged)  # on the call's stream, which the future records
        except BaseException as error:  # DDP raises it where it waits on the future
            future.set_exception(error)


def comm_hook(
    collective: Collective, on_stats: Callable[[AllReduceStats], None] | None = None
) -> Hook:
    """A DDP hook that averages each gradient bucket through `collective`, beside the backward
    pass; `on_stats` sees what each all-reduce cost (on the hook's thread)."""
    calls = _Calls(collective, on_stats)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # DDP hands the bucket's buffer over until the future completes; the collective
        # returns a new tensor (on the bucket's device), so the buffer itself is only read.
        return calls.submit(bucket.buffer())

    hook.calls = calls  # type: ignore[attr-defined]  # for tests: the order calls began in
    return hook
