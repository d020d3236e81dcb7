"""The report's plots, drawn with matplotlib's Agg backend (no display) as PNG files: figures
are made with `matplotlib.figure.Figure`, never pyplot, so no GUI backend or global state is
involved.

Each function takes one or more labelled runs: one run is drawn per worker (with the mean),
several are overlaid one line (or bar, or histogram) per run. A plot whose data no run has is
not drawn; `draw_all` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.report.run import PLOT_TITLES, Run

Labelled = Sequence[tuple[str, Run]]

MAX_WORKER_LINES = 16  # more workers than this: only the mean and the spread are drawn


def _colors(count: int) -> list[tuple[float, float, float, float]]:
    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def _group_mean(keys: np.ndarray, *values: np.ndarray) -> tuple[np.ndarray, ...]:
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


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight", format="png")
    return path


def _faults(axes: Axes, runs: Labelled, colors: list) -> None:
    """Vertical lines at the faults' times (on a time axis)."""
    several = len(runs) > 1
    for (label, run), color in zip(runs, colors, strict=True):
        for index, fault in enumerate(run.faults):
            axes.axvline(fault.t, color=color if several else "0.3", linestyle=":",
                         linewidth=1.2,
                         label=(f"faults ({label})" if several else "faults") if index == 0
                         else None)


def plot_loss(runs: Labelled, path: Path) -> Path | None:
    """Training loss per step: each worker and their mean (one run), or each run's mean with
    its workers' range shaded (several)."""
    runs = [(label, run) for label, run in runs if run.steps]
    if not runs:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    colors = _colors(len(runs))
    for (label, run), color in zip(runs, colors, strict=True):
        steps, loss, rank = run.column("step"), run.column("loss"), run.column("rank")
        unique, mean = _group_mean(steps, loss)
        if len(runs) == 1:
            ranks = np.unique(rank)
            if len(ranks) <= MAX_WORKER_LINES:
                for worker, worker_color in zip(ranks, _colors(len(ranks)), strict=True):
                    mine = rank == worker
                    axes.plot(steps[mine], loss[mine], color=worker_color, linewidth=0.9,
                              alpha=0.6, label=f"worker {int(worker)}")
            axes.plot(unique, mean, color="black", linewidth=2.2, label="mean of workers")
        else:
            order = np.argsort(steps, kind="stable")
            starts = np.searchsorted(steps[order], unique)
            low = np.fmin.reduceat(loss[order], starts)  # fmin/fmax: NaN only if all are
            high = np.fmax.reduceat(loss[order], starts)
            axes.fill_between(unique, low, high, color=color, alpha=0.15, linewidth=0)
            axes.plot(unique, mean, color=color, linewidth=2, label=f"{label} (mean)")
    axes.set_title(PLOT_TITLES["loss"] + (" per worker" if len(runs) == 1
                                     else " per run (band: workers' min to max)"))
    axes.set_xlabel("step")
    axes.set_ylabel("loss (cross-entropy, nats)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2 if len(axes.get_lines()) > 6 else 1)
    return _save(figure, path)


def plot_drift(runs: Labelled, path: Path) -> Path | None:
    """Parameter drift against time since the start, faults marked."""
    runs = [(label, run) for label, run in runs if run.has("drift")]
    if not runs:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    colors = _colors(len(runs))
    for (label, run), color in zip(runs, colors, strict=True):
        t, drift, rank = run.column("t"), run.column("drift"), run.column("rank")
        ok = np.isfinite(drift)
        if len(runs) == 1:
            ranks = np.unique(rank[ok])
            for worker, worker_color in zip(ranks, _colors(len(ranks)), strict=True):
                mine = ok & (rank == worker)
                axes.plot(t[mine], drift[mine], color=worker_color, linewidth=1.1,
                          label=f"worker {int(worker)}")
        else:
            _, mean_t, mean_drift = _group_mean(run.column("step")[ok], t[ok], drift[ok])
            axes.plot(mean_t, mean_drift, color=color, linewidth=2, label=f"{label} (mean)")
    _faults(axes, runs, colors)
    axes.set_title(PLOT_TITLES["drift"])
    axes.set_xlabel("time since start (s)")
    axes.set_ylabel("drift (L2 distance from the mean parameters)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _save(figure, path)


def _histograms(axes: Axes, series: list[tuple[str, np.ndarray, tuple]], unit: str,
                what: str) -> None:
    values = [v[np.isfinite(v)] for _, v, _ in series]
    pooled = np.concatenate(values) if values else np.zeros(0)
    if not pooled.size or not np.any(pooled > 0):
        axes.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center",
                  transform=axes.transAxes, color="0.4")
        axes.set_xticks([])
        axes.set_yticks([])
        return
    edges = np.histogram_bin_edges(pooled, bins=min(40, max(5, int(np.sqrt(pooled.size)))))
    for (label, _, color), value in zip(series, values, strict=True):
        if value.size:
            axes.hist(value, bins=edges, histtype="step", linewidth=1.6, color=color,
                      label=f"{label} (median {np.median(value):.1f} {unit})")
    axes.set_xlabel(f"{what} per step ({unit})")
    axes.set_ylabel("steps")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="x-small")


def plot_stragglers(runs: Labelled, path: Path) -> Path | None:
    """Histograms of the time a step waited after computing (the collective, waiting for
    slower peers) and of the injected straggler delay, in milliseconds."""
    runs = [(label, run) for label, run in runs if run.steps]
    if not runs:
        return None
    waits: list[tuple[str, np.ndarray, tuple]] = []
    delays: list[tuple[str, np.ndarray, tuple]] = []
    if len(runs) == 1 and len(runs[0][1].ranks) <= 8:
        run = runs[0][1]
        rank = run.column("rank")
        wait, delay = run.column("wait_seconds") * 1e3, run.column("injected_delay_seconds") * 1e3
        for worker, color in zip(run.ranks, _colors(len(run.ranks)), strict=True):
            mine = rank == worker
            waits.append((f"worker {worker}", wait[mine], color))
            delays.append((f"worker {worker}", delay[mine], color))
    else:
        for (label, run), color in zip(runs, _colors(len(runs)), strict=True):
            waits.append((label, run.column("wait_seconds") * 1e3, color))
            delays.append((label, run.column("injected_delay_seconds") * 1e3, color))
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2)
    _histograms(left, waits, "ms", "wait after compute")
    left.set_title("Wait after compute (collective + waiting for peers)", fontsize="medium")
    _histograms(right, delays, "ms", "injected straggler delay")
    right.set_title("Injected straggler delay", fontsize="medium")
    figure.suptitle(PLOT_TITLES["stragglers"])
    return _save(figure, path)


def plot_links(runs: Labelled, path: Path) -> Path | None:
    """Grouped bars per link: configured loss (hatched) beside measured loss (solid), in percent,
    one pair per run; the last measurement of each (link, configured loss)."""
    runs = [(label, run) for label, run in runs if run.links]
    if not runs:
        return None
    # Per run and link, the distinct configured losses in the order first measured (a fault may
    # change a link), each with its last measurement; a bar group is (src, dst, k-th setting),
    # so the runs' settings of one link stand side by side.
    keys: list[tuple[str, str, int]] = []
    tables: list[dict[tuple[str, str, int], tuple[float, float]]] = []
    for _, run in runs:
        settings: dict[tuple[str, str], list[float]] = {}
        table: dict[tuple[str, str, int], tuple[float, float]] = {}
        for link in run.links:
            seen = settings.setdefault((link.src, link.dst), [])
            if link.configured_loss not in seen:
                seen.append(link.configured_loss)
            key = (link.src, link.dst, seen.index(link.configured_loss))
            table[key] = (link.configured_loss, link.measured_loss)
            if key not in keys:
                keys.append(key)
        tables.append(table)
    single = len(runs) == 1

    def label(key: tuple[str, str, int]) -> str:
        src, dst, k = key
        if single and (src, dst, 1) in tables[0]:
            return f"{src}→{dst}\n(set {tables[0][key][0] * 100:g}%)"
        return f"{src}→{dst}" + (f"\n(setting {k + 1})" if any(
            (src, dst, 1) in table for table in tables) else "")

    labels = [label(key) for key in keys]
    nan = (np.nan, np.nan)
    configured = np.array([[table.get(key, nan)[0] for key in keys] for table in tables]) * 100
    measured = np.array([[table.get(key, nan)[1] for key in keys] for table in tables]) * 100
    positions = np.arange(len(keys))
    bars = 2 * len(runs)
    width = 0.8 / bars
    figure = Figure(figsize=(max(7.0, 0.9 * len(keys) * len(runs) + 3), 4.5))
    axes = figure.subplots()
    colors = _colors(len(runs)) if len(runs) > 1 else [(0.12, 0.47, 0.71, 1.0)]
    for index, ((label, _), color) in enumerate(zip(runs, colors, strict=True)):
        offset = (2 * index - bars / 2 + 0.5) * width
        prefix = f"{label}: " if len(runs) > 1 else ""
        axes.bar(positions + offset, configured[index], width, color="white", edgecolor=color,
                 hatch="//", label=f"{prefix}configured")
        axes.bar(positions + offset + width, measured[index], width, color=color,
                 edgecolor=color, label=f"{prefix}measured")
    axes.set_xticks(positions, labels, fontsize="small")
    axes.set_title(PLOT_TITLES["links"])
    axes.set_xlabel("link (source → destination)")
    axes.set_ylabel("packet loss (%)")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the bars
    return _save(figure, path)


_DRAW = {"loss": plot_loss, "drift": plot_drift, "stragglers": plot_stragglers,
         "links": plot_links}
_MISSING = {
    "loss": "no step events",
    "drift": "no step recorded a drift",
    "stragglers": "no step events",
    "links": "no link measurements",
}


def draw_all(runs: Labelled, directory: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Every plot of `runs` as `directory/NAME.png`: the files drawn, and why the others were
    not. A stale file of a plot that is no longer drawn is removed."""
    drawn: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for name, draw in _DRAW.items():
        target = directory / f"{name}.png"
        result = draw(runs, target)
        if result is None:
            target.unlink(missing_ok=True)
            skipped[name] = _MISSING[name]
        else:
            drawn[name] = result
    return drawn, skipped
