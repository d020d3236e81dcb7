"""Which cells run, in which labs and in which order; and which need not run at all."""

from __future__ import annotations

import math
from collections.abc import Sequence

from benchmarks.collectives.cells import (
    GRID_RATE,
    KINDS,
    LOSSES,
    RATES,
    SIZES,
    Cell,
    Outcome,
    rate_name,
    size_name,
)


def plan(quick: bool, kinds: Sequence[str] = KINDS, sizes: Sequence[str] | None = None,
         rates: Sequence[str] | None = None, losses: Sequence[float] | None = None,
         grid: Sequence[int] = (), grid_rate: float = GRID_RATE,
         ) -> list[tuple[float | None, float, list[Cell]]]:
    """(rate, loss, cells) per lab, in the order they run: smaller before larger, so a
    collective that timed out need not be tried where it can only be slower. `sizes`, `rates`
    (names, "unshaped" among them) and `losses` keep only the cells they name. With `grid`
    (worlds), only the grid cells of `kinds` (Moshpit, and the ring as a reference over the
    same links): one lab per world."""
    groups: list[tuple[float | None, float, list[Cell]]] = []
    if grid:
        numels = [SIZES["1M"], SIZES["10M"]]
        groups += [(grid_rate, 0.0, [Cell(k, n, grid_rate, 0.0, quick, world, True)
                                     for n in numels for k in kinds]) for world in grid]
    elif quick:
        numels = [SIZES["1M"], SIZES["10M"]]
        groups.append((None, 0.0, [Cell(k, n, None, 0.0, True) for n in numels for k in kinds]))
        for loss in (0.0, 0.10):
            groups.append((100e6, loss, [Cell(k, n, 100e6, loss, True)
                                         for n in numels for k in kinds]))
    else:
        groups.append((None, 0.0, [Cell(k, n, None, 0.0) for n in SIZES.values()
                                   for k in kinds]))
        for rate in RATES.values():
            for loss in LOSSES:
                # 100M (48 s per call at 100 Mbit/s) only at 0% and 10%: the budget's share.
                numels = [n for n in SIZES.values() if n < SIZES["100M"] or loss in (0.0, 0.10)]
                groups.append((rate, loss, [Cell(k, n, rate, loss) for n in numels
                                            for k in kinds]))
    kept = []
    for rate, loss, cells in groups:
        if ((rates is not None and rate_name(rate) not in rates)
                or (losses is not None and not any(math.isclose(loss, x) for x in losses))):
            continue
        cells = [c for c in cells if sizes is None or size_name(c.numel) in sizes]
        if cells:
            kept.append((rate, loss, cells))
    return kept


def hopeless(cell: Cell, outcomes: list[Outcome]) -> Outcome | None:
    """A timed-out outcome of this collective at the same rate with no more loss and no larger
    tensor: this cell would only be slower."""
    for o in outcomes:
        if (o.status == "timeout" and o.cell.kind == cell.kind and o.cell.rate == cell.rate
                and o.cell.loss <= cell.loss and o.cell.numel <= cell.numel):
            return o
    return None
