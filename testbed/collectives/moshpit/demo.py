"""A Moshpit peer process for `testbed moshpit-peer`: every peer all-reduces a tensor that
anyone can recompute, and prints what each call did."""

from __future__ import annotations

import json
import time

import torch

from testbed.collectives.moshpit.peer import Moshpit


def demo_input(rank: int, step: int, numel: int) -> torch.Tensor:
    """The tensor a demo peer contributes at `step`: anyone can recompute it to check results."""
    generator = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return torch.randn(numel, generator=generator)


def run_demo_peer(rank: int, world: int, store: tuple[str, int], *, serve_store: bool = False,
                  listen: str = "127.0.0.1", group_size: int = 4, timeout: float = 5.0,
                  heartbeat: float = 1.0, steps: int = 10, numel: int = 100_000,
                  interval: float = 0.0) -> int:
    """`testbed moshpit-peer`: all-reduce `demo_input` for `steps` steps, one JSON line per
    step on stdout (missing peers, coverage, seconds, the result's head and sum)."""
    peer = Moshpit(rank, world, store=store, listen=(listen, 0), serve_store=serve_store,
                   group_size=group_size, timeout=timeout, heartbeat=heartbeat)
    try:
        for step in range(steps):
            result, stats = peer.allreduce(demo_input(rank, step, numel), step)
            print(json.dumps({
                "step": step, "missing": list(stats.peers_missing), "coverage": stats.coverage,
                "seconds": stats.seconds, "head": result[:4].tolist(),
                "sum": result.double().sum().item(),
            }), flush=True)
            time.sleep(interval)
    finally:
        peer.close()
    return 0
