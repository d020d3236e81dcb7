"""Collectives under study: lossy all-reduce, Moshpit averaging, and the ring and gloo baselines.

`create(kind, rank, world, **options)` builds any of them by name (as a scenario names them);
each keeps the contract in `base.py`, and `hook.comm_hook` lends any of them to a user's DDP model.
`compress(collective, kind, **parameters)` lays a compressor over any of them (`compression/`,
docs/compression.md), keeping the same contract.
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


# Options the cluster supplies from the placement and the topology (addresses, ports, the MTU,
# the congestion control, test hooks); a scenario sets only the others.
PLACEMENT_OPTIONS = frozenset({
    "addresses", "stream_addresses", "master", "store", "listen", "serve_store", "run_id",
    "congestion", "mtu", "listener", "endpoint", "test_loss", "rejoining",
})


def constructor(kind: str) -> type[Collective]:
    """The class of collective `kind` (imported on first use); a bad kind names the allowed."""
    if kind not in KINDS:
        raise ValueError(f"collective.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    module, _, name = KINDS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def options(kind: str) -> dict[str, inspect.Parameter]:
    """The options of collective `kind`: its constructor's keyword-only parameters, by name."""
    return {
        parameter.name: parameter
        for parameter in inspect.signature(constructor(kind)).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def create(kind: str, rank: int, world: int, **given: object) -> Collective:
    """Worker `rank`'s end of collective `kind`; a bad kind or option names what is allowed."""
    allowed = list(options(kind))
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"collective.{unknown[0]}: not an option of {kind!r}; allowed: {', '.join(allowed)}"
        )
    return constructor(kind)(rank, world, **given)


def compress(collective: Collective, kind: str, **parameters: object) -> Collective:
    """`collective` with compressor `kind` (none, topk, randk, arc_topk, int8, int4, powersgd)
    over it: `testbed.collectives.compression.wrap` (imported on first use)."""
    from testbed.collectives.compression import wrap

    return wrap(collective, kind, **parameters)


__all__ = [
    "KINDS", "PLACEMENT_OPTIONS", "AllReduceStats", "Collective", "compress", "constructor",
    "create", "options",
]
