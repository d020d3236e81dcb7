"""The report's plots, drawn with matplotlib's Agg backend (no display) as PNG files: figures
are made with `matplotlib.figure.Figure`, never pyplot, so no GUI backend or global state is
involved.

Each function takes one or more labelled runs: one run is drawn per worker (with the mean),
several are overlaid one line (or bar, or histogram) per run. Time plots share the run's time
axis and its timeline's marks (`drawing.py`). A plot whose data no run has is not drawn;
`draw_all` says why and what would draw it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.report.drawing import (
    MAX_WORKER_LINES,
    Labelled,
    broken,
    colors,
    group_mean,
    layer,
    mark_lines,
    save,
    time_axis,
    timeline_key,
    worker_series,
)
from testbed.report.marks import Mark
from testbed.report.network_plot import plot_network
from testbed.report.run import PLOT_TITLES, Run

WIDE_RANGE = 50  # positive values spanning more than this factor get logarithmic bins


def _step_of(run: Run, mark: Mark) -> tuple[float, float] | None:
    """Where a timeline event lies on a step axis: the step it was scheduled before, or the
    step the workers were at on average when it took effect; None outside training."""
    steps, mean_t = group_mean(run.column("step"), run.column("t"))
    ok = np.isfinite(mean_t)
    steps, mean_t = steps[ok], mean_t[ok]
    if not steps.size or not mean_t[0] <= mark.start <= mean_t[-1]:
        return None
    scheduled = mark.faults[0].fields.get("step")
    start = float(scheduled) if isinstance(scheduled, int) else \
        float(np.interp(mark.start, mean_t, steps))
    return start, float(np.interp(mark.end, mean_t, steps))


def plot_loss(runs: Labelled, path: Path) -> Path | None:
    """Training loss per step: each worker and their mean (one run), or each run's mean with
    its workers' range shaded (several)."""
    runs = [(label, run) for label, run in runs if run.steps]
    if not runs:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    palette = colors(len(runs))
    for position, ((label, run), color) in enumerate(zip(runs, palette, strict=True)):
        steps, loss, rank = run.column("step"), run.column("loss"), run.column("rank")
        unique, mean = group_mean(steps, loss)
        outer = np.unique(steps[np.isfinite(run.column("outer_step"))])
        if outer.size:  # the steps that applied DiLoCo's outer updates, a dashed line each
            several = len(runs) > 1
            axes.vlines(outer, 0, 1, transform=axes.get_xaxis_transform(),
                        color=color if several else "0.5", linestyle="--", linewidth=0.6,
                        alpha=0.5, label=f"outer steps ({label})" if several else "outer steps")
        if len(runs) == 1:
            ranks = np.unique(rank)
            if len(ranks) <= MAX_WORKER_LINES:
                for worker, worker_color in zip(ranks, colors(len(ranks)), strict=True):
                    mine = rank == worker
                    axes.plot(*broken(steps[mine], loss[mine]), color=worker_color,
                              linewidth=0.9, alpha=0.6, label=f"worker {int(worker)}")
            axes.plot(unique, mean, color="black", linewidth=2.2, label="mean of workers")
        else:
            order = np.argsort(steps, kind="stable")
            starts = np.searchsorted(steps[order], unique)
            low = np.fmin.reduceat(loss[order], starts)  # fmin/fmax: NaN only if all are
            high = np.fmax.reduceat(loss[order], starts)
            axes.fill_between(unique, low, high, color=color, alpha=0.15, linewidth=0)
            axes.plot(unique, mean, color=color, linewidth=2 + 1.2 * layer(position, len(runs)),
                      label=f"{label} (mean)")
    axes.set_title(PLOT_TITLES["loss"] + (" per worker" if len(runs) == 1
                                     else " per run (band: workers' min to max)"))
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (cross-entropy, nats)")
    axes.grid(alpha=0.3)
    mark_lines(axes, runs, palette, _step_of)
    axes.legend(fontsize="small", ncol=2 if len(axes.get_lines()) > 6 else 1)
    timeline_key(axes, runs)
    return save(figure, path)


def plot_drift(runs: Labelled, path: Path) -> Path | None:
    """Each worker's parameter drift (a distance, so the axis starts at 0) at every measurement
    over the whole run, the timeline's events marked."""
    runs = [(label, run) for label, run in runs if run.has("drift")]
    if not runs:
        return None
    figure = Figure(figsize=(8, 4.5))
    axes = figure.subplots()
    palette = colors(len(runs))
    time_axis(axes, runs, palette)
    worker_series(axes, runs, palette, "drift", marker="o")
    axes.set_ylim(bottom=0.0)
    axes.set_title(PLOT_TITLES["drift"])
    axes.set_ylabel("drift from the workers' mean, relative\n"
                    r"$\|\theta_{worker} - \bar\theta\| \;/\; \|\bar\theta\|$")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="upper left")
    timeline_key(axes, runs)
    return save(figure, path)


def _histograms(axes: Axes, series: list[tuple[str, np.ndarray, tuple]], what: str) -> None:
    """One step histogram per series (ms), on shared bins: logarithmic where the positive
    values span more than `WIDE_RANGE` (one slow step would crush the rest into one bin), the
    steps at 0 then counted in the legend."""
    values = [v[np.isfinite(v)] for _, v, _ in series]
    positive = np.concatenate(values)[np.concatenate(values) > 0]
    count = min(40, max(5, int(np.sqrt(positive.size))))
    wide = positive.min() * WIDE_RANGE < positive.max()
    edges = np.geomspace(positive.min(), positive.max(), count + 1) if wide else \
        np.histogram_bin_edges(np.concatenate(values), bins=count)
    for (label, _, color), value in zip(series, values, strict=True):
        if value.size:
            zeros = int(np.sum(value <= 0)) if wide else 0
            axes.hist(value, bins=edges, histtype="step", linewidth=1.6, color=color,
                      label=f"{label} (median {np.median(value):.1f} ms"
                      + (f"; {zeros} steps at 0" if zeros else "") + ")")
    if wide:
        axes.set_xscale("log")
    axes.set_xlabel(f"{what} per step (ms{', logarithmic' if wide else ''})")
    axes.set_ylabel("steps")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="x-small")


def plot_stragglers(runs: Labelled, path: Path) -> Path | None:
    """Histograms of the time a step waited after computing (the collective, waiting for
    slower peers) and of the injected straggler delay, in milliseconds; a panel only where some
    step had one, the figure's title saying what was left out."""
    runs = [(label, run) for label, run in runs if run.steps]
    waits: list[tuple[str, np.ndarray, tuple]] = []
    delays: list[tuple[str, np.ndarray, tuple]] = []
    if len(runs) == 1 and len(runs[0][1].ranks) <= 8:
        run = runs[0][1]
        rank = run.column("rank")
        wait, delay = run.column("wait_seconds") * 1e3, run.column("injected_delay_seconds") * 1e3
        for worker, color in zip(run.ranks, colors(len(run.ranks)), strict=True):
            mine = rank == worker
            waits.append((f"worker {worker}", wait[mine], color))
            delays.append((f"worker {worker}", delay[mine], color))
    else:
        for (label, run), color in zip(runs, colors(len(runs)), strict=True):
            waits.append((label, run.column("wait_seconds") * 1e3, color))
            delays.append((label, run.column("injected_delay_seconds") * 1e3, color))
    candidates = [
        (waits, "wait after compute", "a wait", "Wait after compute (collective + waiting for "
         "peers)"),
        (delays, "injected straggler delay", "an injected straggler delay",
         "Injected straggler delay"),
    ]
    recorded = [any(np.any(values > 0) for _, values, _ in c[0]) for c in candidates]
    panels = [c for c, shown in zip(candidates, recorded, strict=True) if shown]
    if not panels:
        return None
    figure = Figure(figsize=(5.5 * len(panels), 4.2))
    for axes, (series, what, _, title) in zip(np.atleast_1d(figure.subplots(1, len(panels))),
                                              panels, strict=True):
        _histograms(axes, series, what)
        axes.set_title(title, fontsize="medium")
    notes = [f"\n(no step had {some}, so it is not drawn)"
             for (_, _, some, _), shown in zip(candidates, recorded, strict=True) if not shown]
    figure.suptitle(PLOT_TITLES["stragglers"] + "".join(notes), y=0.98, va="bottom")
    return save(figure, path)


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
    palette = colors(len(runs)) if len(runs) > 1 else [(0.12, 0.47, 0.71, 1.0)]
    for index, ((label, _), color) in enumerate(zip(runs, palette, strict=True)):
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
    return save(figure, path)


_DRAW = {"loss": plot_loss, "network": plot_network, "drift": plot_drift,
         "stragglers": plot_stragglers, "links": plot_links}
# Why a plot is not drawn, and what would draw it.
_MISSING = {
    "loss": "no step events",
    "network": "no step used a collective (no bytes, datagrams or retransmits recorded)",
    "drift": "no step recorded a drift; a run measures it every `metrics.drift_every` steps "
             "(default 10, 0: never)",
    "stragglers": "no step waited after compute or had an injected straggler delay",
    "links": "no link measurements; `metrics.probe_links: true` has a run measure every shaped "
             "link before training",
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
