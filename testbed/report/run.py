"""Reading a run directory back: `load_run(run_dir)` merges every events file into a `Run`, and
`summarize(run)` computes what `summary.json` holds.

A bad line is a `RunError` naming the file and line number. One exception: the last line of a
file that is not valid JSON and has no newline is what a writer killed mid-write leaves; it is
dropped, and `Run.warnings` says so.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from testbed.report.events import (
    CUMULATIVE,
    LEVELS,
    DriftEvent,
    EndEvent,
    EventError,
    FaultEvent,
    LinkEvent,
    RunEvent,
    StepEvent,
    parse_event,
)

EVENTS = "events.jsonl"
EVENTS_GLOB = "events*.jsonl"
SCENARIO = "scenario.yaml"
SUMMARY = "summary.json"
PLOTS = "plots"
PARAMETERS = "parameters"  # workers' parameter dumps (`metrics.dump_parameters`)
INDEX = "index.html"


# File name, title: the plots in the order the page shows them.
PLOT_TITLES = {
    "loss": "Training loss",
    "network": "Network over time",
    "drift": "Parameter drift over time",
    "stragglers": "Wait after compute and injected straggler delay",
    "links": "Packet loss per link: measured vs configured",
}


class RunError(Exception):
    """A run directory that cannot be read; the message is one line, fit for a user. `code`:
    2 when the path is not a run directory at all, 1 when its contents are bad."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Run:
    """Everything a run directory holds, typed; steps sorted by (rank, step), the other events
    by time."""

    path: Path
    name: str
    started: float | None
    scenario: str | None
    steps: list[StepEvent]
    faults: list[FaultEvent]
    links: list[LinkEvent]
    ends: list[EndEvent]
    other: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    def column(self, name: str, default: float = math.nan) -> np.ndarray:
        """One step field (or a figure of the stats' extra, or `eval_NAME`) over all steps, in
        the order of `steps`, as float64; `default` where a step lacks it."""
        if name.startswith("eval_"):
            key = name[5:]
            values = [s.evaluation.get(key, default) for s in self.steps]
        elif self.steps and hasattr(self.steps[0], name):
            values = [getattr(s, name) for s in self.steps]
            values = [default if v is None else v for v in values]
        else:
            values = [s.extra.get(name, default) for s in self.steps]
        return np.asarray(values, dtype=np.float64)

    @property
    def ranks(self) -> np.ndarray:
        return np.unique(self.column("rank")).astype(int)

    def has(self, name: str) -> bool:
        """Whether some step carries a finite value of `name`."""
        return bool(self.steps) and bool(np.isfinite(self.column(name)).any())

    @property
    def end_t(self) -> float | None:
        """When the run's last step, fault, link measurement or end happened (seconds since
        start): its wall time, and where its time plots end."""
        times = [s.t for s in self.steps] + [e.t for e in (*self.faults, *self.links, *self.ends)]
        return max(times) if times else None

    def traffic(self) -> dict[str, np.ndarray]:
        """The background flows' reports (`traffic` events), per flow: rows of (end time,
        seconds, bytes), in time order."""
        rows: dict[str, list[tuple[float, float, float]]] = {}
        for event in self.other:
            if event.get("type") == "traffic":
                rows.setdefault(str(event["flow"]), []).append(
                    (float(event["t"]), float(event["seconds"]), float(event["bytes"])))
        return {flow: np.array(sorted(found)) for flow, found in sorted(rows.items())}

    @property
    def training_t(self) -> float | None:
        """When training started (the runner's `training` event): what comes before is setup
        (namespaces, workers importing and meeting). None where the writer did not say."""
        return next((float(e["t"]) for e in self.other if e.get("type") == "training"), None)


def _read_lines(path: Path, warnings: list[str]) -> list[tuple[int, Any]]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise RunError(f"{path}: cannot read: {error.strerror or error}") from None
    lines = raw.split(b"\n")
    complete = raw.endswith(b"\n") or not raw
    if complete:
        lines.pop()  # the empty string after the final newline
    events: list[tuple[int, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            if number == len(lines) and not complete:
                warnings.append(f"{path}:{number}: partial last line ignored "
                                f"({len(line)} bytes; the writer was killed mid-write?)")
                continue
            reason = getattr(error, "msg", None) or str(error)
            raise RunError(f"{path}:{number}: not valid JSON: {reason}") from None
        try:
            events.append((number, parse_event(data)))
        except EventError as error:
            kind = data.get("type") if isinstance(data, dict) else None
            what = f"{kind} event" if isinstance(kind, str) else "event"
            raise RunError(f"{path}:{number}: bad {what}: {error}") from None
    return events


def load_run(run_dir: str | Path) -> Run:
    """Read and check `run_dir`: its events files (`events.jsonl` and every
    `events-SOURCE.jsonl`, merged), `scenario.yaml` and `summary.json` where present."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}",
                       code=2)
    files = sorted(path.glob(EVENTS_GLOB))
    if not files:
        raise RunError(f"{path}: no events files ({EVENTS} or events-*.jsonl); not a run "
                       "directory?", code=2)
    warnings: list[str] = []
    steps: list[StepEvent] = []
    faults: list[FaultEvent] = []
    links: list[LinkEvent] = []
    ends: list[EndEvent] = []
    drifts: list[DriftEvent] = []
    other: list[dict[str, Any]] = []
    start: RunEvent | None = None
    for file in files:
        for _, event in _read_lines(file, warnings):
            if isinstance(event, StepEvent):
                steps.append(event)
            elif isinstance(event, FaultEvent):
                faults.append(event)
            elif isinstance(event, LinkEvent):
                links.append(event)
            elif isinstance(event, EndEvent):
                ends.append(event)
            elif isinstance(event, DriftEvent):
                drifts.append(event)
            elif isinstance(event, RunEvent):
                start = start or event
            else:
                other.append(event)
    if not (steps or faults or links or ends):
        raise RunError(f"{path}: no events in {', '.join(f.name for f in files)}")
    seen: dict[tuple[int, int], int] = {}
    for index, event in enumerate(steps):
        key = (event.rank, event.step)
        if key in seen:
            warnings.append(f"{path}: rank {event.rank} step {event.step} recorded twice; "
                            "the later one is used")
        seen[key] = index
    steps = sorted((steps[i] for i in seen.values()), key=lambda s: (s.rank, s.step))
    by_key = {(event.rank, event.step): event for event in steps}
    for drift in drifts:
        if (drift.rank, drift.step) in by_key:
            by_key[drift.rank, drift.step].drift = drift.drift
    scenario_path = path / SCENARIO
    scenario = scenario_path.read_text() if scenario_path.is_file() else None
    summary = None
    summary_path = path / SUMMARY
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as error:
            warnings.append(f"{summary_path}: not valid JSON ({error.msg}); recomputed")
    return Run(
        path=path,
        name=start.name if start else path.resolve().name,
        started=start.started if start else None,
        scenario=scenario,
        steps=steps,
        faults=sorted(faults, key=lambda e: e.t),
        links=sorted(links, key=lambda e: e.t),
        ends=sorted(ends, key=lambda e: e.t),
        other=other,
        summary=summary,
        warnings=warnings,
    )


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _by_rank(values: np.ndarray, index: np.ndarray, count: int, how: str) -> np.ndarray:
    """`values` reduced per rank (`index`: each value's rank position), NaNs ignored."""
    ok = np.isfinite(values)
    sums = np.bincount(index[ok], weights=values[ok], minlength=count)
    if how == "sum":
        return sums
    counts = np.bincount(index[ok], minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def _last_by_rank(values: np.ndarray, index: np.ndarray, count: int) -> np.ndarray:
    """The last finite value of each rank (steps are sorted by step within a rank)."""
    result = np.full(count, np.nan)
    ok = np.isfinite(values)
    result[index[ok]] = values[ok]  # later assignments win
    return result


def command_runs(run: Run) -> list[dict[str, Any]]:
    """A command job's workers: how often each started its command (a restart runs it again;
    a killed run writes no exit), the last exit code and its seconds, and the seconds of every
    run that exited."""
    started: dict[int, int] = {}
    exits: dict[int, list[dict[str, Any]]] = {}
    for event in run.other:
        if event.get("type") == "command":
            rank = int(event["rank"])
            if event.get("phase") == "start":
                started[rank] = started.get(rank, 0) + 1
            elif event.get("phase") == "exit":
                exits.setdefault(rank, []).append(event)
    return [{"rank": rank, "runs": count,
             "exit_code": exits[rank][-1].get("code") if rank in exits else None,
             "seconds": exits[rank][-1].get("seconds") if rank in exits else None,
             "total_seconds": sum(e.get("seconds") or 0.0 for e in exits.get(rank, []))}
            for rank, count in sorted(started.items())]


def summarize(run: Run, success: bool | None = None, error: str | None = None) -> dict[str, Any]:
    """Per worker and overall: steps, final loss, mean step time, drop rate, bytes, datagrams
    lost, retransmits, wall time, success. `success` None: the run's own end event, else no
    worker reported failure."""
    ranks = run.ranks if run.steps else np.zeros(0, dtype=int)
    count = len(ranks)
    index = np.searchsorted(ranks, run.column("rank").astype(int)) if count else np.zeros(0, int)
    t = run.column("t")
    computed = _by_rank(run.column("micro_batches", 0.0), index, count, "sum")
    dropped = _by_rank(run.column("micro_batches_dropped", 0.0), index, count, "sum")
    with np.errstate(invalid="ignore", divide="ignore"):
        drop_rate = dropped / (computed + dropped)
    extras = sorted({k for s in run.steps for k in s.extra})
    per: dict[str, np.ndarray] = {
        "steps": np.bincount(index, minlength=count).astype(float),
        "final_loss": _last_by_rank(run.column("loss"), index, count),
        "mean_step_seconds": _by_rank(run.column("step_seconds"), index, count, "mean"),
        "mean_compute_seconds": _by_rank(run.column("compute_seconds"), index, count, "mean"),
        "mean_wait_seconds": _by_rank(run.column("wait_seconds"), index, count, "mean"),
        "injected_delay_seconds": _by_rank(run.column("injected_delay_seconds"), index, count,
                                           "sum"),
        "drop_rate": drop_rate,
        "bytes_sent": _by_rank(run.column("bytes_sent", 0.0), index, count, "sum"),
        "bytes_received": _by_rank(run.column("bytes_received", 0.0), index, count, "sum"),
        "wall_seconds": _last_by_rank(t, index, count),
        "final_drift": _last_by_rank(run.column("drift"), index, count),
    }
    for name in extras:
        values = run.column(name)
        per[name] = (_last_by_rank(values, index, count) if name in CUMULATIVE
                     else _by_rank(values, index, count, "mean" if name in LEVELS else "sum"))
    evaluation_names = sorted({k for s in run.steps for k in s.evaluation})
    for name in evaluation_names:
        per[f"final_eval_{name}"] = _last_by_rank(run.column(f"eval_{name}"), index, count)
    ended = {e.rank: e for e in run.ends}
    workers = []
    for position, rank in enumerate(ranks):
        row: dict[str, Any] = {"rank": int(rank)}
        for key, values in per.items():
            value = _finite(values[position])
            row[key] = int(value) if key in ("steps", "bytes_sent", "bytes_received") and \
                value is not None else value
        end = ended.get(int(rank))
        row["success"] = end.success if end else None
        row["error"] = end.error if end else None
        workers.append(row)
    own = ended.get(None)
    if success is None:
        success = own.success if own else not any(w["success"] is False for w in workers)
    if error is None and own is not None:
        error = own.error
    def overall(key: str, how: str) -> float | None:
        if not count:
            return None
        values = per[key]
        if not np.isfinite(values).any():
            return None
        return _finite(float(np.nansum(values) if how == "sum" else np.nanmean(values)))

    total_computed, total_dropped = float(computed.sum()), float(dropped.sum())
    summary: dict[str, Any] = {
        "name": run.name,
        "success": bool(success),
        "error": error,
        "workers": count,
        "steps": int(per["steps"].max()) if count else 0,
        "final_loss": overall("final_loss", "mean"),
        "mean_step_seconds": _finite(float(np.nanmean(run.column("step_seconds"))))
        if run.has("step_seconds") else None,
        "mean_wait_seconds": _finite(float(np.nanmean(run.column("wait_seconds"))))
        if run.has("wait_seconds") else None,
        "drop_rate": total_dropped / (total_computed + total_dropped)
        if total_computed + total_dropped else None,
        "bytes_sent": int(per["bytes_sent"].sum()) if count else 0,
        "bytes_received": int(per["bytes_received"].sum()) if count else 0,
        "wall_seconds": run.end_t,
        "faults": len(run.faults),
        "final_drift": overall("final_drift", "mean"),
    }
    for name in extras:
        summary[name] = overall(name, "mean" if name in LEVELS else "sum")
    for name in evaluation_names:
        summary[f"final_eval_{name}"] = overall(f"final_eval_{name}", "mean")
    summary["links"] = [
        {"src": link.src, "dst": link.dst, "configured_loss": link.configured_loss,
         "measured_loss": link.measured_loss, "t": link.t}
        for link in run.links
    ]
    summary["per_worker"] = workers
    commands = command_runs(run)
    if commands:
        summary["workers"] = max(summary["workers"], len(commands))
        summary["commands"] = commands
    capture = next((e for e in reversed(run.other) if e.get("type") == "capture"), None)
    if capture is not None:  # what crossed the captured links (capture/flows.json)
        summary["capture"] = {key: capture[key] for key in
                              ("directory", "flows", "truncated", "links", "error")
                              if key in capture}
    if run.warnings:
        summary["warnings"] = list(run.warnings)
    return summary


def parameter_dumps(run_dir: str | Path) -> dict[tuple[int, int], np.ndarray]:
    """The workers' parameter dumps (`metrics.dump_parameters`), by (rank, step)."""
    dumps = {}
    for path in sorted((Path(run_dir) / PARAMETERS).glob("rank*-step*.npy")):
        rank, step = path.stem.removeprefix("rank").split("-step")
        dumps[int(rank), int(step)] = np.load(path)
    return dumps


def describe_runs(root: str | Path, log_lines: int = 12) -> str:
    """Every run directory under `root` (found by its `logs/` or its events), for a failed
    test's report: its summary's verdict and error, each worker's steps over time
    (`describe_steps`: who fell behind), and the last `log_lines` lines (none: 0) of each log
    and of each command job's stderr."""
    parts = []
    runs = {path.parent for path in Path(root).rglob("logs") if path.is_dir()}
    runs |= {path.parent for path in Path(root).rglob(EVENTS)}
    for run in sorted(runs):
        summary = run / SUMMARY
        if summary.exists():
            try:
                data = json.loads(summary.read_text())
                parts.append(f"{run}: success={data.get('success')} error={data.get('error')}")
            except ValueError as error:
                parts.append(f"{run}: {SUMMARY} unreadable ({error})")
        else:
            parts.append(f"{run}: no {SUMMARY}")
        parts.extend(describe_steps(run))
        logs = run / "logs"
        for log in sorted([*logs.glob("*.log"), *logs.glob("*.stderr")]) if log_lines else []:
            lines = log.read_text(errors="replace").splitlines()[-log_lines:]
            parts.append(f"--- {log.name} (last {len(lines)} lines)")
            parts.extend(lines)
    return "\n".join(parts)


def describe_steps(run_dir: str | Path) -> list[str]:
    """Each worker's steps over time, a line each: its first and last step and when (seconds
    since the run's start), its longest step, and its longest gap between two step events
    (the step and whatever held the worker between steps), with when."""
    try:
        run = load_run(run_dir)
    except RunError as error:
        return [f"steps: not readable ({error})"]
    lines = []
    for rank in sorted({step.rank for step in run.steps}):
        steps = [step for step in run.steps if step.rank == rank]
        first, last = steps[0], steps[-1]
        line = (f"rank {rank}: steps {first.step}..{last.step} ({len(steps)} recorded), "
                f"t {first.t:.1f}..{last.t:.1f} s")
        longest = max(steps, key=lambda step: step.step_seconds
                      if math.isfinite(step.step_seconds) else -1.0)
        if math.isfinite(longest.step_seconds):
            line += (f"; longest step {longest.step_seconds:.2f} s (step {longest.step}, "
                     f"t {longest.t:.1f} s)")
        if len(steps) > 1:
            gap, after = max(((b.t - a.t, b) for a, b in itertools.pairwise(steps)),
                             key=lambda pair: pair[0])  # steps do not compare: ties by gap
            line += f"; longest gap {gap:.2f} s (before step {after.step}, t {after.t:.1f} s)"
        lines.append(line)
    return lines
