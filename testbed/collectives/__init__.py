"""Collectives under study: lossy all-reduce, Moshpit averaging, and the ring and gloo baselines.

`create(kind, rank, world, **options)` builds any of them by name (as a scenario names them);
each keeps the contract in `base.py`, and `hook.comm_hook` lends any of them to a user's DDP model.
"""

from __future__ import annotations

import importlib
import inspect

from testbed.collectives.base import AllReduceStats, Collective

# kind -> "module:class"; modules load on first use (torch.distributed, threads, sockets).
KINDS = {
    "ring": "testbed.collectives.ring:Ring",
    "gloo": "testbed.collectives.gloo:Gloo",
    "moshpit": "testbed.collectives.moshpit:Moshpit",
    "lossy": "testbed.collectives.lossy:Lossy",
}


def create(kind: str, rank: int, world: int, **options: object) -> Collective:
    """Worker `rank`'s end of collective `kind`; a bad kind or option names what is allowed."""
    if kind not in KINDS:
        raise ValueError(f"collective.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    module, _, name = KINDS[kind].partition(":")
    constructor = getattr(importlib.import_module(module), name)
    allowed = [
        parameter.name
        for parameter in inspect.signature(constructor).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"collective.{unknown[0]}: not an option of {kind!r}; allowed: {', '.join(allowed)}"
        )
    return constructor(rank, world, **options)


__all__ = ["KINDS", "AllReduceStats", "Collective", "create"]
