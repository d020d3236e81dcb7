"""What the report's plots share: colours, means per key, saving, and the run's time axis.

A time plot spans the whole run, from its start (0 s) to its last event, not only the training:
what came before training (setup: namespaces, workers importing and meeting) and after its last
step (evaluation, shutdown) is shaded, and every event of the timeline is a dotted line numbered
as in the key under the figure and the page's Faults table (`marks.py`).
A worker's series over time is broken where the worker was away (a kill, a restart), and
workers whose series coincide are drawn once and named together, so four equal lines do not
pass for one worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.report.marks import Mark, timeline_marks
from testbed.report.run import Run

Labelled = Sequence[tuple[str, Run]]
Color = tuple[float, float, float, float]

MAX_WORKER_LINES = 16  # more workers than this: only the mean is drawn
KEY_LINES = 12  # timeline events listed under a figure; the page's Faults table has them all
COINCIDE = 0.005  # series apart by less than this fraction of their largest value coincide
LAYERED = 6  # up to this many lines that may meet, each is drawn wider than the next
MARK_COLOR = "0.3"  # the timeline's lines, where one run is drawn
NOT_TRAINING_COLOR = "0.92"


def colors(count: int) -> list[Color]:
    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def group_mean(keys: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
    """The distinct `keys` and, for each of `values`, its mean per key (NaNs ignored)."""
    unique, inverse = np.unique(keys, return_inverse=True)
    means = []
    for value in values:
        ok = np.isfinite(value)
        sums = np.bincount(inverse[ok], weights=value[ok], minlength=len(unique))
        counts = np.bincount(inverse[ok], minlength=len(unique))
        with np.errstate(invalid="ignore", divide="ignore"):
            means.append(sums / counts)
    return (unique, *means)


def layer(order: int, count: int) -> int:
    """How much wider than the next to draw the `order`-th of `count` lines (0 for the last,
    and for all beyond `LAYERED`): where lines meet for a while, each still shows around the
    one drawn over it."""
    return count - 1 - order if count <= LAYERED else 0


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight", format="png")
    return path


def broken(steps: np.ndarray, *series: np.ndarray) -> tuple[np.ndarray, ...]:
    """`steps` and `series` (sorted by step) with a NaN wherever the steps jump by more than
    1.5 times their usual stride: a worker that was away is not drawn as a straight line across
    its absence."""
    if len(steps) < 3:
        return (steps, *series)
    jumps = np.diff(steps)
    cuts = np.flatnonzero(jumps > 1.5 * np.median(jumps)) + 1
    return tuple(np.insert(np.asarray(a, dtype=float), cuts, np.nan) for a in (steps, *series))


def mark_lines(axes: Axes, runs: Labelled, palette: list[Color],
               where: Callable[[Run, Mark], tuple[float, float] | None],
               numbered: bool = True) -> None:
    """Each run's timeline events as dotted lines at `where(run, mark)` (start, end; a ramp's
    span shaded), numbered at the top (labels of nearby lines step down so they stay legible).
    Call it once the axes' x limits are final."""
    several = len(runs) > 1
    low, high = axes.get_xlim()
    for (label, run), color in zip(runs, palette, strict=True):
        line_color = color if several else MARK_COLOR
        legend = (f"timeline events ({label})" if several else "timeline events") \
            if numbered else None
        previous, row = -np.inf, 0
        for mark in timeline_marks(run):
            position = where(run, mark)
            if position is None:
                continue
            start, end = position
            axes.axvline(start, color=line_color, linestyle=":", linewidth=1.3, zorder=1,
                         label=legend)
            legend = None  # one entry per run
            if end > start:
                axes.axvspan(start, end, color=line_color, alpha=0.08, linewidth=0)
            if numbered:
                row = row + 1 if start - previous < 0.03 * (high - low) else 0
                previous = start
                axes.annotate(str(mark.number), xy=(start, 1.0),
                              xycoords=("data", "axes fraction"), xytext=(2, -2 - 9 * (row % 4)),
                              textcoords="offset points", ha="left", va="top",
                              fontsize="x-small", fontweight="bold", color=line_color)


def time_axis(axes: Axes, runs: Labelled, palette: list[Color], numbered: bool = True) -> None:
    """The x axis over the whole run (0 to the last event of the longest run), the time
    before training started and after its last step shaded (one run), the timeline's events
    marked."""
    end = max((run.end_t or 0.0) for _, run in runs)
    axes.set_xlim(0.0, end * 1.01 if end > 0 else 1.0)
    if len(runs) == 1:
        run = runs[0][1]
        last_step = max((step.t for step in run.steps), default=None)
        spans = [(0.0, run.training_t), (last_step, end)]
        label = "not training (setup, shutdown)" if numbered else None
        for start, stop in spans:
            if start is not None and stop is not None and stop > start:
                axes.axvspan(start, stop, color=NOT_TRAINING_COLOR, linewidth=0, zorder=0,
                             label=label)
                label = None
    mark_lines(axes, runs, palette, lambda _, mark: (mark.start, mark.end), numbered)
    axes.set_xlabel("time since the run started (s)")


def timeline_key(axes: Axes, runs: Labelled) -> None:
    """Under `axes` (the figure's lowest), below its axis label: what each numbered line is,
    with when it took effect."""
    several = len(runs) > 1
    lines = [f"{f'{label}: ' if several else ''}{mark.number}  at {mark.start:.1f} s  "
             f"{mark.text}" for label, run in runs for mark in timeline_marks(run)]
    if not lines:
        return
    if len(lines) > KEY_LINES:
        lines = [*lines[:KEY_LINES], f"... and {len(lines) - KEY_LINES} more (the page's "
                 "Faults table lists them all)"]
    shown = [line if len(line) <= 110 else line[:109] + "…" for line in lines]
    axes.annotate("Timeline events:\n" + "\n".join(shown), xy=(0.0, 0.0),
                  xycoords="axes fraction", xytext=(-50, -34), textcoords="offset points",
                  ha="left", va="top", fontsize="small", color=MARK_COLOR,
                  annotation_clip=False)


def _coinciding(series: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[list[int]]:
    """The ranks grouped by series that coincide (the same steps, values apart by less than
    `COINCIDE` of the largest), in rank order."""
    scale = max((float(np.max(np.abs(v))) for _, _, v in series.values() if v.size), default=0.0)
    groups: list[list[int]] = []
    for rank, (steps, _, values) in series.items():
        for group in groups:
            first_steps, _, first_values = series[group[0]]
            if np.array_equal(steps, first_steps) and \
                    np.all(np.abs(values - first_values) <= COINCIDE * scale):
                group.append(rank)
                break
        else:
            groups.append([rank])
    return groups


def worker_series(axes: Axes, runs: Labelled, palette: list[Color], column: str,
                  marker: str | None = None, drawstyle: str = "default") -> None:
    """`column` of the steps against time: one run, a line per worker (workers that coincide
    drawn once, named together, and said when all do), or their mean beyond `MAX_WORKER_LINES`;
    several runs, each run's mean per step at the step's mean time. `drawstyle` `steps-pre`
    draws a value over the interval that ends at its event (a step's duration)."""
    several = len(runs) > 1
    for order, ((label, run), color) in enumerate(zip(runs, palette, strict=True)):
        steps, t, value = run.column("step"), run.column("t"), run.column(column)
        rank = run.column("rank")
        ok = np.isfinite(value)
        ranks = np.unique(rank[ok]).astype(int)
        if several or len(ranks) > MAX_WORKER_LINES:
            mean_steps, mean_t, mean_value = group_mean(steps[ok], t[ok], value[ok])
            _, x, y = broken(mean_steps, mean_t, mean_value)
            larger = layer(order, len(runs))
            axes.plot(x, y, color=color if several else "black", linewidth=2 + 1.2 * larger,
                      marker=marker, markersize=3 + 1.5 * larger, drawstyle=drawstyle,
                      label=f"{label} (mean of workers)" if several else "mean of workers")
            continue
        series = {int(r): (steps[ok & (rank == r)], t[ok & (rank == r)],
                           value[ok & (rank == r)]) for r in ranks}
        worker_colors = dict(zip(series, colors(len(series)), strict=True))
        groups = _coinciding(series)
        for position, group in enumerate(groups):
            _, x, y = broken(*series[group[0]])
            name = f"worker {group[0]}" if len(group) == 1 else \
                f"workers {', '.join(map(str, group))} (equal)"
            larger = layer(position, len(groups)) if marker else 0  # noisy lines stay thin
            axes.plot(x, y, color=worker_colors[group[0]], linewidth=1.3 + 0.6 * larger,
                      marker=marker, markersize=3.5 + 1.5 * larger, drawstyle=drawstyle,
                      label=name)
        if len(groups) == 1 and len(ranks) > 1:
            zero = not np.any(value[ok])
            axes.text(0.5, 0.9, f"all {len(ranks)} workers equal"
                      + (f": {column.replace('_', ' ')} 0 throughout" if zero else ""),
                      transform=axes.transAxes, ha="center", va="top", fontsize="small",
                      bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})
