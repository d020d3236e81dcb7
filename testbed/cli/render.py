"""What the commands show: rich tables and the lines beside them, built from what a command
found or ran. Nothing here runs, measures or decides an exit code."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from netem.capabilities import Capabilities
    from netem.probe import Check, ProbeResult
    from netem.trace import Lateness, TraceSummary
    from testbed.cluster.runner import ClusterRun, RunResult

VERDICTS = {True: "[green]pass[/green]", False: "[red]FAIL[/red]"}
NOT_REPEATABLE = ("the fallback's loss is not repeatable: nftables' numgen takes no seed "
                  "(netem's decisions follow each link's seed: docs/profiles.md)")


def number(value: float | None, digits: int = 4) -> str:
    """A figure to `digits` significant digits; `-` for none (or NaN)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        f"{value:.{digits}g}")


def capabilities_table(capabilities: Capabilities,
                       consequences: Mapping[str, tuple[str, str]]) -> Table:
    """`testbed doctor`: each capability, whether it is here, what was found, what follows
    (without netem: that the fallback's loss is not repeatable)."""
    table = Table(title="testbed doctor")
    if not dict(capabilities.items()).get("netem"):
        table.caption = f"without netem, {NOT_REPEATABLE}"
    for column in ("capability", "here", "found", "what follows"):
        table.add_column(column)
    for name, available in capabilities.items():
        answer = "[green]yes[/green]" if available else "[red]no[/red]"
        found = capabilities.details.get(name, "")
        table.add_row(name, answer, found, consequences[name][0 if available else 1])
    return table


def probe_table(title: str, checks: Iterable[Check], *, expected: bool) -> tuple[Table, list[str]]:
    """`testbed probe`: each quantity measured, and with an expected profile its check; the
    notes say why a quantity was not checked (the table's footnotes)."""
    table = Table(title=title)
    columns = ("quantity", "configured", "measured", "tolerance", "result")
    for column in columns if expected else ("quantity", "measured"):
        table.add_column(column)
    notes: list[str] = []
    for check in checks:
        measured = check.show(check.measured)
        if not expected:
            table.add_row(check.quantity, measured)
            continue
        if check.passed is None:
            notes += [check.note] if check.note not in notes else []
            verdict = f"[dim]not checked ({notes.index(check.note) + 1})[/dim]"
        else:
            verdict = VERDICTS[check.passed]
        tolerance = "-" if check.passed is None else f"± {check.show(check.tolerance)}"
        table.add_row(check.quantity, check.show(check.configured), measured, tolerance, verdict)
    return table, notes


def probe_summary(result: ProbeResult) -> str:
    """`testbed probe`: the trains sent, what arrived, the loss bursts and delay percentiles."""
    p = result.delay_percentiles
    return (
        f"{result.sent} probes of {result.size} bytes every {result.interval * 1e6:.0f} us; "
        f"{result.received} arrived ({result.arrivals} with duplicates), {result.corrupt} "
        f"damaged, {result.malformed} malformed; loss bursts: max {result.loss_burst_max}; "
        f"delay p50/p90/p99 {p[50] * 1e3:.3f}/{p[90] * 1e3:.3f}/{p[99] * 1e3:.3f} ms"
        + (f"; sent ECN-capable, {result.marked} marked CE" if result.ecn_capable else "")
        + (f"; rate over {result.rate_frames} frames of {result.rate_frame_bytes} bytes, "
           f"{result.rate_offered / 1e6:.1f} Mbit/s offered" if result.rate is not None else "")
        + ("" if result.ended else "; no end-of-train marker arrived (receiver timed out)")
    )


def rules_table(iface: str, netns: str | None, rules: Mapping) -> Table:
    """`testbed shape`: an interface's rules, the profile per source."""
    table = Table(title=f"{iface}" + (f" in {netns}" if netns else ""))
    for column in ("from", "profile"):
        table.add_column(column)
    for source, profile in rules.items():
        table.add_row(source or "everyone else", str(profile))
    return table


def applied_line(iface: str, applied: Mapping) -> str:
    """`testbed shape`: how the rules were applied (backend, direction, tree, offloads)."""
    how = "changed in place" if applied["in_place"] else "built"
    offloads = ", ".join(applied["offloads_disabled"]) or "none"
    return (f"{applied['backend']} backend, {applied['direction']} (tree on "
            f"{applied['device']}), {how}; offloads off on {iface}: {offloads}")


def trace_line(summary: TraceSummary) -> str:
    """`testbed shape --trace`: what the trace holds, as `describe` reports it."""
    from netem.units import format_rate

    rates = "no rate"
    if summary.mean_rate is not None:
        mean, least, most = (format_rate(round(value or 0)) for value in
                             (summary.mean_rate, summary.min_rate, summary.max_rate))
        rates = f"rate mean {mean}, min {least}, max {most}"
    floor = f", {summary.floor_windows} windows without an opportunity" if (
        summary.floor_windows) else ""
    return (f"{summary.source}: {summary.length:g}s in {summary.windows} windows of "
            f"{summary.resolution * 1000:g}ms, {', '.join(summary.fields)}; {rates}{floor}")


def replay_line(iface: str, late: Lateness, *, interrupted: bool) -> str:
    """`testbed shape --trace`: how the replay went, and that the interface is restored."""
    how = "stopped (Ctrl-C)" if interrupted else "ended"
    return (f"{iface}: replay {how}, shaping restored; {late.changes} changes, late by "
            f"{late.mean * 1000:.2f}ms mean, {late.p99 * 1000:.2f}ms p99, "
            f"{late.max * 1000:.2f}ms max; {late.skipped} windows skipped")


def demo_table(rows: Iterable[Sequence[str]], elapsed: float) -> Table:
    """`testbed demo`: each link's quantities, configured against measured (rows ending in
    their verdict, pass or FAIL)."""
    table = Table(title=f"testbed demo: configured vs measured ({elapsed:.0f} s)")
    for column in ("kernel", "link", "quantity", "configured", "measured", "tolerance", "result"):
        table.add_column(column)
    styles = {"pass": VERDICTS[True], "FAIL": VERDICTS[False]}
    for *cells, verdict in rows:
        table.add_row(*cells, styles[verdict])
    return table


def live_table(cluster: ClusterRun) -> Table:
    """Each worker's state: a training job's step, loss, timing, coverage, losses and drift;
    a command job's status, how long it has run and its exit code."""
    scenario, workers = cluster.scenario, cluster.workers
    view = Table(title=f"{scenario.name}: {scenario.summary()}")
    if scenario.command is not None:
        columns = ("worker", "status", "running (s)", "exit code")
        rows = [(w.seconds if w.seconds is not None else
                 time.monotonic() - w.started if w.started is not None else None, w)
                for w in workers]
        cells = [[number(seconds, 3), "-" if w.exit_code is None else str(w.exit_code)]
                 for seconds, w in rows]
    else:
        datagrams = scenario.collective.capabilities.datagrams  # lost ones are counted
        columns = ("worker", "status", "step", "loss", "step time (s)", "coverage",
                   *(["datagrams lost"] if datagrams else []), "drift")
        cells = [[f"{w.step + 1}/{scenario.job.steps}", number(w.loss),
                  number(w.step_seconds, 3), number(w.coverage, 3),
                  *([f"{w.datagrams_lost:.0f}"] if datagrams else []), number(w.drift, 3)]
                 for w in workers]
    for column in columns:
        view.add_column(column)
    if cluster.metrics_urls and not os.environ.get("TESTBED_IN_GUEST"):
        first, last = cluster.metrics_urls[0], cluster.metrics_urls[-1]
        view.caption = (f"/metrics of worker 0: {first}" if first == last else
                        f"/metrics of workers 0..{len(workers) - 1}: {first} .. {last}")
    for w, row in zip(workers, cells, strict=True):
        status = w.status + (f" (restarted {w.restarts}x)" if w.restarts else "")
        view.add_row(str(w.rank), status, *row)
    return view


def summary_table(cluster: ClusterRun, result: RunResult) -> Table:
    """`testbed run`, at the end: each worker's outcome (a command job's exit code and time, a
    training job's steps, final loss and evaluation); shaped by the fallback, that its loss is
    not repeatable."""
    summary = Table(title=f"{cluster.scenario.name}: summary ({result.seconds:.1f} s)")
    if cluster.shaped_by == "fallback":
        summary.caption = f"shaped by the fallback: {NOT_REPEATABLE}"
    if cluster.scenario.command is not None:
        for column in ("worker", "status", "exit code", "seconds", "restarts"):
            summary.add_column(column)
        for w in result.workers:
            summary.add_row(str(w.rank), w.status,
                            "-" if w.exit_code is None else str(w.exit_code),
                            number(w.seconds, 3), str(w.restarts))
        return summary
    for column in ("worker", "status", "steps", "final training loss", "evaluation"):
        summary.add_column(column)
    for w in result.workers:
        evaluation = ", ".join(f"{k} {v:.4g}" for k, v in sorted(w.evaluation.items()))
        summary.add_row(str(w.rank), w.status, str(w.step + 1), number(w.loss),
                        evaluation or "-")
    return summary


def flows_table(flows: dict, *, rows: int) -> Table:
    """Per captured link, its largest flows: what was sent and received, lost, retransmitted,
    reordered, duplicated, and the median delay."""
    table = Table(title="capture: what crossed each link, per flow", caption="packets: recv "
                  "received, retx retransmitted, reord reordered, dup duplicated; p50: the "
                  "median one-way delay")
    for column in ("link", "flow", "sent", "recv", "lost", "retx", "reord", "dup", "p50 ms"):
        table.add_column(column, no_wrap=column == "flow")
    for link in flows["links"]:
        shown = link["flows"][:rows]
        for flow in shown:
            ends = (f"{flow['protocol']} {flow['sport']}>{flow['dport']}"
                    if flow["protocol"] != "other" else "other")
            delay = flow["delay_seconds"]
            table.add_row(link["link"], ends, f"{flow['sent_packets']}",
                          f"{flow['received_packets']}", f"{flow['lost']}",
                          f"{flow['retransmitted']}", f"{flow['reordered']}",
                          f"{flow['duplicated']}",
                          "-" if delay is None else f"{delay['median'] * 1e3:.3g}")
        if not shown:
            table.add_row(link["link"], "(nothing crossed)", *["0"] * 6, "-")
        hidden = len(link["flows"]) - len(shown)
        if hidden:
            table.add_row(link["link"], f"... {hidden} more flow(s)", *[""] * 7)
    return table


def capture_notes(flows: dict) -> list[str]:
    """What limits the counts: files cut at their size limit, frames the capture dropped."""
    notes = []
    for link in flows["links"]:
        cut = [side for side, truncated in link["truncated"].items() if truncated]
        if cut:
            notes.append(f"[yellow]{link['link']}: {' and '.join(cut)} file cut at "
                         f"{flows['max_bytes']} bytes: counted as far as both files go")
        dropped = {side: n for side, n in link["kernel_drops"].items() if n}
        if dropped:
            notes.append(f"[yellow]{link['link']}: the capture missed frames ("
                         + ", ".join(f"{side} {n}" for side, n in dropped.items())
                         + "): the host could not keep up; lost counts are too high by as many")
    return notes


def compose_report_lines(report: dict) -> list[str]:
    """`testbed compose --up`: each worker's end, what was left behind, the run directory."""
    lines = [f"{service}: {state['state']}, exit code {state['exit_code']}"
             for service, state in report.get("workers", {}).items()]
    left = report.get("left", {})
    lines.append(f"left behind: {sum(map(len, left.values()))} containers, networks, volumes"
                 if left else "left up (--keep)")
    lines.append(f"run directory: {report.get('run_dir', 'none')} "
                 f"({'succeeded' if report.get('success') else 'FAILED'}, "
                 f"{report.get('seconds', '?')} s, in the {report['where']})")
    return lines
