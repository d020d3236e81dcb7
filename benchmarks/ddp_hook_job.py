"""examples/ddp/train.py with a hook the profile of `benchmarks.ddp_hook --profile` asks for.

    python ddp_hook_job.py HOOK [train.py's options]

HOOK is `lossy` (the scenario's collective, as train_lossy.py gives it; rank 0 prints a JSON
line per call: its step, how long it queued behind earlier buckets, its seconds, phases and
datagrams), `local` (a hook that hands DDP the bucket back at once: the computation and DDP's
own work without any communication) or `local-thread` (the same through the hook's thread and
futures: what the hand-offs alone cost).
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "ddp"))
from train import main

from testbed.collectives.base import AllReduceStats
from testbed.collectives.hook import Hook, comm_hook
from testbed.ddp import scenario_hook

HOOKS = ("lossy", "local", "local-thread")


class Local:
    """A collective that gives each worker its own tensor back: the hook without a network."""

    name = "local"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        return tensor, AllReduceStats(self.name, step)


def local(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket back, already complete: no thread, no network."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def profiled(rank: int) -> Hook:
    """The scenario's hook; on rank 0, one JSON line per call of where its time went."""
    submitted: list[tuple[float, int]] = []  # per call: when DDP handed it over, its step
    step = 0

    def record(stats: AllReduceStats) -> None:
        ended = time.monotonic()
        at, in_step = submitted[stats.step]
        print(json.dumps({
            "call": stats.step, "in_step": in_step, "seconds": stats.seconds,
            "queued": max(0.0, ended - stats.seconds - at), "phases": stats.phases,
            "datagrams_sent": getattr(stats, "datagrams_sent", 0),
            "datagrams_received": getattr(stats, "datagrams_received", 0),
            "bytes_sent": stats.bytes_sent,
            "parity_peers": stats.extra.get("parity_peers", 0.0),
            "chunks_missing": stats.extra.get("chunks_missing", 0.0)}), flush=True)

    inner = scenario_hook(on_stats=record if rank == 0 else None)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        nonlocal step
        submitted.append((time.monotonic(), step))
        step += bucket.is_last()
        return inner(state, bucket)

    return hook


def chosen(name: str) -> Hook:
    rank = int(os.environ.get("RANK", "0"))
    if name == "lossy":
        return profiled(rank)
    if name == "local-thread":
        return comm_hook(Local(rank))
    return local


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in HOOKS:
        raise SystemExit(f"usage: ddp_hook_job.py HOOK [train.py's options]; HOOK: one of "
                         f"{', '.join(HOOKS)}, got {sys.argv[1:2]}")
    name = sys.argv.pop(1)
    main(comm_hook=lambda: chosen(name))
