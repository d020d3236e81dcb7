"""The inputs every rank all-reduces, and how a result is checked against their true mean."""

from __future__ import annotations

import math

from benchmarks.collectives.cells import WORLD

SEED = 20261122
OFFSETS = (-3.0, -1.0, 0.5, 3.5)  # input_r = mean + OFFSETS[r] * noise; no subset sums to 0
TOLERANCE = 1e-5


def offsets(world: int) -> tuple[float, ...]:
    """The inputs' offsets (input_r = mean + offsets[r] * noise): they sum to zero and no
    proper subset does. Four workers: OFFSETS. More: every offset but the last positive
    (0.1 to 0.11) and the last the negative of their sum, so a subset sums to zero only with
    the last and all the others; small, so float32 rounding stays far below TOLERANCE."""
    if world == len(OFFSETS):
        return OFFSETS
    rest = [0.1 * (1 + rank / world**2) for rank in range(world - 1)]
    return (*rest, -sum(rest))


def spread(world: int) -> float:
    """The inputs' rms offset."""
    return math.sqrt(sum(c * c for c in offsets(world)) / world)


def make_input(rank: int, numel: int, world: int = WORLD):
    """(the true mean, this rank's input): the inputs average to the mean exactly, and no
    proper subset of them does, so a result that left a worker out cannot pass as correct.
    Built in place: no temporaries inflate the memory baseline."""
    import torch

    mean = torch.randn(numel, generator=torch.Generator().manual_seed(SEED))
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(SEED + 1))
    mine.mul_(offsets(world)[rank]).add_(mean)
    return mean, mine


def compare(result, mean, mine, block: int = 1 << 20) -> tuple[bool, float]:
    """(result equals the mean within TOLERANCE, |result - mean| / |own input - mean|), in
    blocks so the check allocates nothing the size of the tensor."""
    import torch

    exact, error, alone = True, 0.0, 0.0
    for start in range(0, mean.numel(), block):
        r, m, x = (t[start:start + block] for t in (result, mean, mine))
        exact = exact and bool(torch.allclose(r, m, rtol=TOLERANCE, atol=TOLERANCE))
        error += (r - m).double().pow(2).sum().item()
        alone += (x - m).double().pow(2).sum().item()
    return exact, math.sqrt(error / alone) if alone else 0.0
