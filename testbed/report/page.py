"""Rendering: the plots and one HTML page, for a run (`render_run`) or several side by side
(`render_comparison`)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netem.extras import MissingExtra, require
from testbed.report.marks import timeline_marks
from testbed.report.run import INDEX, PLOT_TITLES, SUMMARY, Run, load_run, summarize
from testbed.report.run import PLOTS as PLOTS_DIR
from testbed.scenario import ScenarioError, load_scenario

COMPARISON = "comparison.html"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
.warn { color: #a45a00; } .fail { color: #b00020; font-weight: bold; }
.ok { color: #1b7a1b; font-weight: bold; } pre { background: #f7f7f7; padding: 1em; }
"""

# Summary figures shown on the pages: key, heading, format.
_FIGURES = [
    ("success", "success", "bool"),
    ("workers", "workers", "int"),
    ("steps", "steps", "int"),
    ("final_loss", "final training loss", ".4f"),
    ("final_eval_loss", "final held-out loss", ".4f"),
    ("final_eval_perplexity", "final held-out perplexity", ".3f"),
    ("final_eval_accuracy", "final held-out accuracy", ".3f"),
    ("mean_step_seconds", "mean step time (s)", ".4f"),
    ("mean_wait_seconds", "mean wait after compute (s)", ".4f"),
    ("drop_rate", "DropCompute drop rate", ".1%"),
    ("wall_seconds", "wall time (s)", ".1f"),
    ("bytes_sent", "bytes sent", "bytes"),
    ("datagrams_lost", "datagrams lost", "int"),
    ("tcp_retransmits", "TCP retransmits", "int"),
    ("final_drift", "final relative drift", ".4g"),
    ("faults", "fault events", "int"),
]
_WORKER_FIGURES = [
    ("success", "success", "bool"),
    ("steps", "steps", "int"),
    ("final_loss", "final training loss", ".4f"),
    ("mean_step_seconds", "mean step time (s)", ".4f"),
    ("mean_compute_seconds", "mean compute (s)", ".4f"),
    ("mean_wait_seconds", "mean wait after compute (s)", ".4f"),
    ("injected_delay_seconds", "injected straggler delay (s)", ".3f"),
    ("drop_rate", "DropCompute drop rate", ".1%"),
    ("bytes_sent", "bytes sent", "bytes"),
    ("bytes_received", "bytes received", "bytes"),
    ("datagrams_lost", "datagrams lost", "int"),
    ("tcp_retransmits", "TCP retransmits", "int"),
    ("final_drift", "final relative drift", ".4g"),
]


def format_value(value: Any, style: str) -> str:
    """A summary figure as the pages (and the CLI) show it; `–` where absent."""
    if value is None:
        return "–"
    if style == "bool":
        return "yes" if value else "no"
    if style == "int":
        return f"{round(value):,}"
    if style == "bytes":
        for unit in ("B", "kB", "MB", "GB"):
            if abs(value) < 1000 or unit == "GB":
                return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1000
    return format(value, style)


def _cell(value: Any, style: str) -> str:
    text = html.escape(format_value(value, style))
    if style == "bool" and value is not None:
        return f'<td class="{"ok" if value else "fail"}">{text}</td>'
    return f"<td>{text}</td>"


def _table(rows: Sequence[tuple[str, dict[str, Any]]], figures: list[tuple[str, str, str]],
           first: str) -> str:
    present = [f for f in figures if any(row.get(f[0]) is not None for _, row in rows)]
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in present)
    body = "".join(
        f'<tr><td class="text">{html.escape(label)}</td>'
        + "".join(_cell(row.get(key), style) for key, _, style in present) + "</tr>"
        for label, row in rows
    )
    return (f'<table><tr><th class="text">{html.escape(first)}</th>{head}</tr>{body}'
            "</table>")


def _with_code(text: str) -> str:
    """`text` escaped, its `backquoted` parts (field names) as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


_TIME_PLOTS = ("<p>The plots against time span the whole run, from its start to its last event; "
               "grey: before training started (setup) and after its last step (evaluation, "
               "shutdown). Each numbered dotted line is an event of the timeline, numbered as "
               "in the key under the plot and in the Faults table.</p>")


def _figures(drawn: dict[str, Path], skipped: dict[str, str], base: Path) -> str:
    parts = [_TIME_PLOTS] if drawn.keys() & {"network", "drift"} else []
    for name, title in PLOT_TITLES.items():
        if name in drawn:
            source = drawn[name].relative_to(base).as_posix()
            parts.append(f'<figure><img src="{html.escape(source)}" alt="{html.escape(title)}">'
                         f"<figcaption>{html.escape(title)}</figcaption></figure>")
        else:
            parts.append(f"<p class=\"warn\">{html.escape(title)}: not drawn "
                         f"({_with_code(skipped[name])}).</p>")
    return "\n".join(parts)


def _draw(runs: list[tuple[str, Run]], directory: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The plots (`plots.draw_all`), or none, each saying why, without matplotlib."""
    try:
        require("matplotlib", "reports", "the report's plots")
    except MissingExtra as error:
        return {}, dict.fromkeys(PLOT_TITLES, str(error))
    from testbed.report.plots import draw_all

    return draw_all(runs, directory)


def _network(run: Run) -> str:
    """The network the run had: where it was shaped and with what TCP congestion control, and
    every directed link's profile before the timeline changed any (links of one profile in
    one row); the faults below say what changed."""
    if not run.scenario:
        return ""
    try:
        scenario = load_scenario(run.scenario)
    except ScenarioError as error:
        return f"<h2>Network</h2><p>The scenario cannot be read: {html.escape(str(error))}</p>"
    cluster = next((e for e in run.other if e.get("type") == "cluster"), {})
    where = ", ".join(f"{key} {html.escape(str(cluster[key]))}"
                      for key in ("backend", "prefix") if key in cluster)
    chosen = cluster.get("congestion") or {"all": scenario.topology.congestion}
    congestion = (next(iter(set(chosen.values()))) if len(set(chosen.values())) == 1 else
                  ", ".join(f"worker {rank}: {name}" for rank, name in chosen.items()))
    grouped: dict[str, list[str]] = {}
    for (src, dst), profile in sorted(scenario.links().items()):
        grouped.setdefault(str(profile) or "unshaped", []).append(f"{src}→{dst}")
    rows = "".join(f'<tr><td class="text">{html.escape(profile)}</td>'
                   f'<td class="text">{", ".join(links)}</td></tr>'
                   for profile, links in grouped.items())
    return (f"<h2>Network</h2><p>{scenario.count} workers; {where or 'shaped'}; TCP "
            f"congestion control {html.escape(congestion)}.</p>"
            f'<table><tr><th class="text">profile</th><th class="text">links</th></tr>{rows}'
            "</table>")


def _commands(commands: list[dict[str, Any]]) -> str:
    rows = "".join(
        f'<tr><td class="text">worker {c["rank"]}</td><td>{c["runs"]}</td>'
        f'<td>{c["exit_code"]}</td><td>{format_value(c["seconds"], ".2f")}</td></tr>'
        for c in commands)
    return ('<h2>Commands</h2><table><tr><th class="text">worker</th><th>runs</th>'
            f"<th>last exit code</th><th>last run (s)</th></tr>{rows}</table>")


def _capture(capture: dict[str, Any]) -> str:
    """Each captured link's totals (capture/flows.json has them per flow)."""
    if capture.get("error"):
        return f'<h2>Capture</h2><p class="warn">{html.escape(str(capture["error"]))}</p>'
    names = ("sent_packets", "received_packets", "lost", "retransmitted", "reordered",
             "duplicated", "unmatched")
    rows = "".join(
        f'<tr><td class="text">{html.escape(str(link["link"]))}</td>'
        + "".join(f"<td>{link.get(name, 0)}</td>" for name in names)
        + f'<td class="text">{html.escape(_bounds(link))}</td></tr>'
        for link in capture.get("links", []))
    heads = "".join(f"<th>{name.replace('_', ' ')}</th>" for name in names)
    files = html.escape(str(capture.get("flows", "capture/flows.json")))
    return (f"<h2>Capture</h2><p>Per flow: <code>{files}</code>; the pcap files beside it "
            f'open in Wireshark.</p><table><tr><th class="text">link</th>{heads}'
            f'<th class="text">files</th></tr>{rows}</table>')


def _bounds(link: dict[str, Any]) -> str:
    notes = [f"{side} truncated" for side, cut in link.get("truncated", {}).items() if cut]
    notes += [f"{side}: {count} dropped by the capture" for side, count in
              link.get("kernel_drops", {}).items() if count]
    return "; ".join(notes) or "complete"


def _warnings(warnings: list[str]) -> str:
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f'<h2>Warnings</h2><ul class="warn">{items}</ul>'


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n"
            f"<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


@dataclass
class Rendered:
    """What a render wrote: the page, the plots drawn, and why the others were not."""

    html: Path
    plots: dict[str, Path]
    skipped: dict[str, str]
    summary: dict[str, Any]
    warnings: list[str]


def run_summary(run: Run) -> dict[str, Any]:
    """The run's `summary.json` where it has one (the runner's success flag is authoritative),
    its figures refreshed from the events."""
    summary = summarize(run)
    if run.summary:
        for key in ("success", "error"):
            if key in run.summary:
                summary[key] = run.summary[key]
    return summary


def render_run(run_dir: str | Path | Run, out_dir: str | Path | None = None) -> Rendered:
    """Draw the plots of one run into `OUT/plots/` and write `OUT/index.html` (OUT: the run
    directory unless given). A run without `summary.json` (killed) gets one, success false."""
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    summary = run_summary(run)
    if run.summary is None and out == run.path:
        if not any(e.rank is None for e in run.ends):
            summary["success"] = False
            summary["error"] = summary.get("error") or "the run did not finish (no summary.json)"
        (run.path / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    drawn, skipped = _draw([(run.name, run)], out / PLOTS_DIR)
    body = [
        f"<p>Run directory: <code>{html.escape(str(run.path.resolve()))}</code></p>",
        "<h2>Summary</h2>",
        _table([(run.name, summary)], _FIGURES, "run"),
    ]
    if summary.get("error"):
        body.append(f'<p class="fail">Error: {html.escape(str(summary["error"]))}</p>')
    body += [_warnings(run.warnings), _network(run)]
    if summary.get("commands"):
        body.append(_commands(summary["commands"]))
    if summary.get("capture"):
        body.append(_capture(summary["capture"]))
    body += ["<h2>Plots</h2>", _figures(drawn, skipped, out), "<h2>Workers</h2>",
             _table([(f"worker {w['rank']}", w) for w in summary["per_worker"]],
                    _WORKER_FIGURES, "worker")]
    if run.faults:
        rows = "".join(
            f'<tr><td>{mark.number}</td><td>{f.t:.2f}</td>'
            f'<td>{"–" if f.scheduled is None else f"{f.scheduled:.2f}"}'
            f'</td><td class="text">{html.escape(f.action)}</td><td class="text">'
            f"{html.escape(json.dumps(f.fields, default=str))}</td></tr>"
            for mark in timeline_marks(run) for f in mark.faults)
        body.append('<h2>Faults</h2><table><tr><th>#</th><th>t (s)</th><th>scheduled (s)</th>'
                    f'<th class="text">action</th><th class="text">details</th></tr>{rows}'
                    "</table>")
    if run.links:
        rows = "".join(
            f'<tr><td class="text">{html.escape(link.label)}</td><td>{link.t:.2f}</td>'
            f"<td>{link.configured_loss:.2%}</td><td>{link.measured_loss:.2%}</td></tr>"
            for link in run.links)
        body.append('<h2>Links</h2><table><tr><th class="text">link</th><th>t (s)</th>'
                    f"<th>configured loss</th><th>measured loss</th></tr>{rows}</table>")
    if run.scenario:
        body.append(f"<h2>Scenario</h2><pre>{html.escape(run.scenario)}</pre>")
    out.mkdir(parents=True, exist_ok=True)
    page = out / INDEX
    page.write_text(_page(f"Run report: {run.name}", "\n".join(body)))
    return Rendered(page, drawn, skipped, summary, list(run.warnings))


def labels_for(runs: Sequence[Run]) -> list[str]:
    """Each run's name, made unique (a suffix `#2`, ... on repeats); the directory's name where
    runs share their own name but not their directory name."""
    names = [run.name for run in runs]
    if len(set(names)) < len(names):
        directories = [run.path.resolve().name for run in runs]
        if len(set(directories)) == len(directories):
            names = directories
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return labels


def render_comparison(run_dirs: Sequence[str | Path | Run], out_dir: str | Path) -> Rendered:
    """Overlay several runs in one set of plots in `OUT/plots/`, and write
    `OUT/comparison.html` with a table of each run's figures."""
    runs = [r if isinstance(r, Run) else load_run(r) for r in run_dirs]
    labels = labels_for(runs)
    out = Path(out_dir)
    drawn, skipped = _draw(list(zip(labels, runs, strict=True)), out / PLOTS_DIR)
    summaries = [run_summary(run) for run in runs]
    warnings = [w for run in runs for w in run.warnings]
    directories = "".join(
        f'<tr><td class="text">{html.escape(label)}</td><td class="text"><code>'
        f"{html.escape(str(run.path.resolve()))}</code></td></tr>"
        for label, run in zip(labels, runs, strict=True))
    body = [
        "<h2>Summary</h2>",
        _table(list(zip(labels, summaries, strict=True)), _FIGURES, "run"),
        _warnings(warnings),
        "<h2>Plots</h2>",
        _figures(drawn, skipped, out),
        '<h2>Runs</h2><table><tr><th class="text">run</th><th class="text">directory</th></tr>'
        f"{directories}</table>",
    ]
    out.mkdir(parents=True, exist_ok=True)
    page = out / COMPARISON
    page.write_text(_page(f"Comparison of {len(runs)} runs: {', '.join(labels)}",
                          "\n".join(body)))
    overall = {label: summary for label, summary in zip(labels, summaries, strict=True)}
    return Rendered(page, drawn, skipped, overall, warnings)
