"""What the training, compression and DDP hook benchmarks share: one cell is one scenario run by
`ClusterRun` within a timeout, and a failed or slow cell is recorded, never the end of the
benchmark."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ScenarioRun:
    """How one cell's run ended: `status` ok, failed or timeout, `note` why, `run` its run
    directory as read back (None if unreadable), `evaluations` the workers' last held-out
    evaluations."""

    status: str
    note: str
    wall: float
    run: Any = None
    evaluations: list[dict[str, float]] = field(default_factory=list)


def run_scenario(scenario: dict[str, Any], name: str, workdir: Path,
                 timeout: float) -> ScenarioRun:
    """Write `scenario` as workdir/NAME.yaml and run it into workdir/NAME within `timeout`."""
    from testbed.cluster.runner import ClusterRun, RunTimeout
    from testbed.report.run import load_run

    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    run_dir = workdir / name
    runner = ClusterRun(path, run_dir=run_dir, backend="auto")
    started = time.monotonic()
    status, note = "ok", ""
    try:
        result = runner.run(timeout=timeout)
        if not result.success:
            status, note = "failed", result.error or ""
    except RunTimeout:
        status, note = "timeout", f"timed out after {timeout:.0f} s"
    except Exception as error:  # one failed cell does not end the benchmark
        status, note = "failed", f"{type(error).__name__}: {error}"
    if status == "failed":
        note = worker_error(run_dir) or note
    outcome = ScenarioRun(status, note, wall=time.monotonic() - started,
                          evaluations=[w.evaluation for w in runner.workers if w.evaluation])
    try:
        outcome.run = load_run(run_dir)
    except Exception as error:
        outcome.note += f" (run unreadable: {error})"
    return outcome


def worker_error(run_dir: Path) -> str:
    """The last line of the first worker log that ends in an error (gloo's timeout, say)."""
    for log in sorted((run_dir / "logs").glob("worker-*.log")):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if line.strip()]
        if lines and "Error" in lines[-1]:
            message = re.sub(r"\[[^]]*\] ", "", lines[-1])  # gloo's source location
            return f"{log.stem}: {message[-160:]}"
    return ""


def fmt(value: float | None, digits: int = 3) -> str:
    """A table cell: `digits` significant digits, '-' for no value."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def status_text(outcome: Any) -> str:
    """A cell's status column: `ok`, or how it ended and why where a note says."""
    if outcome.status == "ok":
        return "ok"
    return f"{outcome.status}: {outcome.note}" if outcome.note else outcome.status
