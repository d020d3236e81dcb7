"""The network over time, from the step events: what the receivers lost (datagrams, or TCP
retransmits where the collective streams), the collective's traffic sent and received, the
background flows that competed with it (a scenario's `traffic:`), and each worker's step time,
one panel each over the whole run with the timeline's events marked. The other plots show what
training made of the network; this one shows the network itself.

Counts become rates in bins of a fixed width: each step's count falls in the bin of the moment
it ended, so a bin holds a few steps of every worker (at least two median steps wide).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.report.drawing import (
    Labelled,
    colors,
    save,
    time_axis,
    timeline_key,
    worker_series,
)
from testbed.report.run import PLOT_TITLES, Run

NICE_WIDTHS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
MAX_BINS = 150


def _carries_network(run: Run) -> bool:
    return run.has("datagrams_lost") or run.has("tcp_retransmits") or \
        bool(np.any(run.column("bytes_sent", 0.0) > 0)) or bool(run.traffic())


def bin_edges(runs: Labelled) -> np.ndarray:
    """Bins over the longest run: the narrowest `NICE_WIDTHS` at most `MAX_BINS` to the run and
    at least two median steps wide."""
    end = max((run.end_t or 0.0) for _, run in runs) or 1.0
    steps = np.concatenate([run.column("step_seconds") for _, run in runs])
    steps = steps[np.isfinite(steps)]
    least = max(end / MAX_BINS, 2 * float(np.median(steps)) if steps.size else 0.0)
    width = next((w for w in NICE_WIDTHS if w >= least), NICE_WIDTHS[-1])
    return np.arange(0.0, end + width, width)


def per_second(run: Run, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """`values` (one per step, NaN where absent) summed over the workers in each bin of
    `edges`, per second."""
    ok = np.isfinite(values)
    sums, _ = np.histogram(run.column("t")[ok], bins=edges, weights=values[ok])
    return sums / np.diff(edges)


def since_previous(run: Run, name: str) -> np.ndarray:
    """A figure that counts since the sockets opened (`tcp_retransmits`), per step: each
    worker's increase over its previous step (a restarted worker's count starts again)."""
    values, rank = run.column(name), run.column("rank")
    result = np.full_like(values, np.nan)
    for worker in np.unique(rank):
        mine = np.flatnonzero((rank == worker) & np.isfinite(values))
        counts = values[mine]
        increase = np.diff(counts, prepend=0.0)
        result[mine] = np.where(increase < 0, counts, increase)
    return result


def _losses(axes: Axes, runs: Labelled, palette: list, edges: np.ndarray,
            datagrams: bool) -> None:
    """Datagrams lost per second (a datagram collective), else TCP retransmits per second."""
    several = len(runs) > 1
    what, unit = ("datagrams lost", "a datagram lost") if datagrams else \
        ("TCP retransmits", "a TCP retransmit")
    nothing = True
    for (label, run), color in zip(runs, palette, strict=True):
        counts = run.column("datagrams_lost") if datagrams else \
            since_previous(run, "tcp_retransmits")
        if not np.isfinite(counts).any():
            continue
        total = float(np.nansum(counts))
        nothing = nothing and total == 0
        axes.stairs(per_second(run, counts, edges), edges, linewidth=1.4,
                    color=color if several else "tab:red",
                    label=f"{label + ': ' if several else ''}{what}: {total:,.0f} in all")
    axes.set_ylabel(f"{what} /s" + ("\n(counted by the receivers)" if datagrams else ""))
    if nothing:  # a flat line at 0 on an axis of hundredths would look like noise
        axes.set_ylim(0.0, 1.0)
        axes.text(0.5, 0.5, f"not {unit} in the whole run", transform=axes.transAxes,
                  ha="center", va="center", color="0.3")
    else:
        axes.set_ylim(bottom=0.0)


def _traffic(axes: Axes, runs: Labelled, palette: list, edges: np.ndarray) -> None:
    several = len(runs) > 1
    for (label, run), color in zip(runs, palette, strict=True):
        for name, style in (("sent", "-"), ("received", "--")):
            values = run.column(f"bytes_{name}", 0.0)
            rate = per_second(run, values, edges) * 8 / 1e6
            axes.stairs(rate, edges, color=color if several else
                        ("tab:blue" if name == "sent" else "tab:green"), linestyle=style,
                        linewidth=1.4, label=f"{label + ': ' if several else ''}{name} "
                        f"({float(values.sum()) / 1e6:,.1f} MB in all)")
    axes.set_ylabel("the collective's traffic,\nall workers (Mbit/s)")
    axes.set_ylim(bottom=0.0)


def _competing(axes: Axes, runs: Labelled, palette: list) -> None:
    """Each background flow's throughput over each of its reports (a line per report's span,
    broken where the flow was silent)."""
    several = len(runs) > 1
    styles = ("-", "--", ":", "-.")
    for (label, run), color in zip(runs, palette, strict=True):
        flows = run.traffic()
        flow_colors = colors(len(flows)) if not several else [color] * len(flows)
        for index, ((flow, rows), flow_color) in enumerate(zip(flows.items(), flow_colors,
                                                               strict=True)):
            end, seconds, sent = rows.T
            rate = sent * 8 / np.maximum(seconds, 1e-9) / 1e6
            nan = np.full_like(end, np.nan)
            x = np.column_stack([end - seconds, end, nan]).ravel()
            y = np.column_stack([rate, rate, nan]).ravel()
            mean = float(sent.sum() * 8 / max(float(seconds.sum()), 1e-9) / 1e6)
            axes.plot(x, y, color=flow_color, linewidth=1.4,
                      linestyle=styles[index % len(styles)] if several else "-",
                      label=f"{label + ': ' if several else ''}{flow} "
                      f"({mean:,.1f} Mbit/s while on)")
    axes.set_ylabel("background flows,\nreceived (Mbit/s)")
    axes.set_ylim(bottom=0.0)


def plot_network(runs: Labelled, path: Path) -> Path | None:
    """Losses (where the collective counts them), traffic and step time against time since
    the start, panels sharing the run's time axis; runs without a collective (local steps
    only) are left out."""
    runs = [(label, run) for label, run in runs if _carries_network(run)]
    if not runs:
        return None
    palette = colors(len(runs))
    edges = bin_edges(runs)
    datagrams = any(run.has("datagrams_lost") for _, run in runs)
    counted = datagrams or any(run.has("tcp_retransmits") for _, run in runs)
    competing = any(run.traffic() for _, run in runs)
    count = 2 + counted + competing
    figure = Figure(figsize=(9, 2.8 * count))
    panels = list(figure.subplots(count, 1, sharex=True))
    if counted:
        _losses(panels[0], runs, palette, edges, datagrams)
    _traffic(panels[counted], runs, palette, edges)
    if competing:
        _competing(panels[-2], runs, palette)
    worker_series(panels[-1], runs, palette, "step_seconds", drawstyle="steps-pre")
    panels[-1].set_ylabel("step time (s),\nover each step")
    panels[-1].set_ylim(bottom=0.0)
    for index, axes in enumerate(panels):
        time_axis(axes, runs, palette, numbered=index == 0)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if axes is not panels[-1]:
            axes.set_xlabel("")
    figure.suptitle(f"{PLOT_TITLES['network']} (rates in bins of {edges[1] - edges[0]:g} s)",
                    y=0.9, va="bottom")
    timeline_key(panels[-1], runs)
    return save(figure, path)
