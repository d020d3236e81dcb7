"""Parameter drift measured from the actual parameter vectors, by a shared random projection.

Every worker sketches its flat parameter vector x into k numbers with the same random matrix S
(the same on every worker because it is seeded by the step, never by the rank), the workers
exchange their k numbers reliably, and since S is linear

    S x_i - mean_j S x_j = S (x_i - mean_j x_j)

each worker holds a sketch of its own distance from the workers' mean. S is a sparse
Johnson-Lindenstrauss projection (a CountSketch): column c has a single nonzero, a random sign
in a random one of the k rows, so E ||S v||^2 = ||v||^2 for every v and the relative standard
error of ||S v|| is about 1/sqrt(2k) (9% for k = 64), the same as a dense Gaussian projection,
at the cost of one pass over the vector. The columns are drawn in blocks of `BLOCK` on a grid
fixed in the flat vector, each block from its own generator seeded by (seed, step, block), so a
slice of the vector projects with the very columns it has in the whole: the owners of a sharded
vector can each project their own shard (`offset`), and the sum of those sketches is the sketch
of the owners' authoritative vector (`reference_from_shards`).

The sketch is accumulated in float64: a drift of 1e-6 of the parameters' norm is still
resolved (a float32 sketch would lose it in the subtraction). Identical vectors give identical
sketches, so a drift of exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK = 1 << 16  # columns drawn per generator: the memory a projection needs beyond its input
DEFAULT_K = 64


@dataclass(frozen=True)
class Drift:
    """How far one worker's parameters are from the reference: `absolute` (L2, in parameter
    units), `relative` (absolute / the reference's L2 norm), both estimates from k numbers."""

    absolute: float
    relative: float
    reference_norm: float


def _generator(seed: int, step: int, block: int, k: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, step, block, k]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def projection(
    params: torch.Tensor, step: int, k: int = DEFAULT_K, *, offset: int = 0, seed: int = 0
) -> torch.Tensor:
    """The k-number sketch (float64) of `params` (any shape, flattened) with the projection of
    `step`; `params` sits at `offset` in the flat vector every worker projects."""
    if k < 1:
        raise ValueError(f"k: expected at least 1, got {k}")
    if step < 0 or offset < 0 or seed < 0:
        raise ValueError(f"step, offset and seed must be >= 0, got {step}, {offset}, {seed}")
    flat = params.detach().reshape(-1)
    out = torch.zeros(k, dtype=torch.float64)
    end = offset + flat.numel()
    position = offset
    while position < end:
        block, start = divmod(position, BLOCK)
        length = min(BLOCK - start, end - position)
        # One draw per column: the row is draw // 2, the sign draw % 2.
        draws = torch.randint(2 * k, (BLOCK,), generator=_generator(seed, step, block, k))
        draws = draws[start:start + length]
        values = flat[position - offset:position - offset + length].to(torch.float64)
        values = torch.where(draws % 2 == 1, -values, values)
        out.index_add_(0, draws // 2, values)
        position += length
    return out


def reference_from_shards(shard_projections: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sketch of the owners' authoritative vector from each owner's sketch of its own shard
    (`projection(shard, step, k, offset=shard_start)`): the projection is linear."""
    return torch.stack([p.to(torch.float64) for p in shard_projections]).sum(0)


def drift_from(
    projections_by_rank: Mapping[int, torch.Tensor],
    mine: torch.Tensor,
    reference: torch.Tensor | None = None,
) -> Drift:
    """This worker's drift from `reference` (a sketch; default: the mean of every worker's
    sketch in `projections_by_rank`, usually this worker's included) given its own sketch
    `mine`. All sketches must come from the same step, k and seed."""
    if reference is None:
        if not projections_by_rank:
            raise ValueError("projections_by_rank: no sketches to take the mean of")
        reference = torch.stack([p.to(torch.float64) for p in projections_by_rank.values()])
        reference = reference.mean(0)
    reference = reference.to(torch.float64)
    if reference.shape != mine.shape:
        raise ValueError(f"sketches of different k: {tuple(mine.shape)} and "
                         f"{tuple(reference.shape)}")
    absolute = float(torch.linalg.vector_norm(mine.to(torch.float64) - reference))
    norm = float(torch.linalg.vector_norm(reference))
    # A zero reference: no drift is 0, any drift infinitely large against it.
    relative = absolute / norm if norm > 0 else (math.inf if absolute else 0.0)
    return Drift(absolute, relative, norm)


def gather_over(collective: Any, sketch: torch.Tensor, step: int) -> dict[int, torch.Tensor] | None:
    """Every worker's sketch, exchanged through one all-reduce of a (world, k) tensor in which
    each worker fills its own row (the mean times world is every row). Only an exact call is
    used: if the collective says it left anything out (coverage below 1: lossy, moshpit with a
    failed peer) this returns None and the drift is not measured this time. The values travel
    as float32 (the wire's widest float): the caller should measure with the returned rows,
    its own included, so identical vectors still give a drift of 0."""
    rank, world = collective.rank, collective.world
    rows = torch.zeros(world, sketch.numel(), dtype=torch.float32)
    rows[rank] = sketch.to(torch.float32)
    mean, stats = collective.allreduce(rows, step)
    if stats.coverage < 1.0:
        return None
    gathered = mean.reshape(world, -1).to(torch.float64) * world
    return {r: gathered[r] for r in range(world)}
