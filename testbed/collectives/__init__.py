"""Collectives under study: lossy all-reduce, Moshpit averaging, and the ring and gloo baselines.

`create(kind, rank, world, **options)` builds any of them by name (as a scenario names them,
`registry.py` declares them); each keeps the contract in `base.py`, and `hook.comm_hook` lends
any of them to a user's DDP model. `compress(collective, compressor, **parameters)` lays one
over any of them (`compression/`, docs/compression.md), keeping the same contract. `lab` puts
a ring, lossy or Moshpit worker on every host of a `netem.lab.Lab` and runs calls in each
host's namespace at once (import it by name: it loads torch).

Importing this package loads no torch: an implementation is imported when it is created.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from testbed.collectives.base import AllReduceStats, Collective, CollectiveBase
from testbed.collectives.capabilities import Capabilities
from testbed.collectives.registry import Placement, kind, kinds


def implementation(name: str) -> type[CollectiveBase]:
    """The class of collective `name` (imported on first use); a bad name names the allowed."""
    module, _, attribute = kind(name).implementation.partition(":")
    return getattr(importlib.import_module(module), attribute)


def create(name: str, rank: int, world: int, **given: Any) -> CollectiveBase:
    """Worker `rank`'s end of collective `name` with `given` constructor options (the
    scenario's and the placement's); a bad name or option names what is allowed."""
    cls = implementation(name)
    allowed = [parameter.name for parameter in inspect.signature(cls).parameters.values()
               if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(
            f"collective.{unknown[0]}: not an option of {name!r}; allowed: {', '.join(allowed)}"
        )
    return cls(rank, world, **given)


def place(name: str, placement: Placement, options: dict[str, Any]) -> CollectiveBase:
    """Collective `name` for a worker at `placement` with the scenario's `options`."""
    return create(name, placement.rank, placement.world, **options,
                  **kind(name).place(placement))


def compress(collective: Collective, compressor: str, **parameters: Any) -> Collective:
    """`collective` with `compressor` (none, topk, randk, arc_topk, int8, int4, powersgd) over
    it: `testbed.collectives.compression.wrap` (imported on first use)."""
    from testbed.collectives.compression import wrap

    return wrap(collective, compressor, **parameters)


__all__ = [
    "AllReduceStats", "Capabilities", "Collective", "CollectiveBase", "Placement", "compress",
    "create", "implementation", "kind", "kinds", "place",
]
