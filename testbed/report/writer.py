"""Writing a run directory while the run goes on.

One file per writing process: the parent (the cluster runner) writes `events.jsonl` (the `run`
line first, then faults, link measurements and the end), each worker `events-rank{N}.jsonl`.
No two processes append to one file, so lines never interleave; every line is one `os.write`
on an `O_APPEND` descriptor, so a killed process leaves at most one partial last line, which
the reader tolerates. Within a process a writer is thread-safe. The reader merges the files.

    writer = RunWriter.create(run_dir, scenario=text_or_mapping, name="lossy-5pct")
    # in each worker process (spawned, given run_dir and rank):
    worker = RunWriter.open(run_dir, rank=rank)
    train(config, collective, rank, world, on_step=worker.step)   # or worker.step(record, drift=d)
    worker.end(success=True); worker.close()
    # back in the parent:
    writer.fault("set", scheduled=60.0, link="east<->west", set={"loss": "10%"})
    writer.link(src=0, dst=4, configured_loss=0.10, measured_loss=0.097)
    writer.finish()          # end event + summary.json; then render(run_dir) for plots and HTML
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from testbed.report.events import FORMAT, step_fields
from testbed.report.run import (
    EVENTS,
    PARAMETERS,
    PLOTS,
    SCENARIO,
    SUMMARY,
    RunError,
    load_run,
    summarize,
)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


class RunWriter:
    """Appends events of one source (`main` or a worker's rank) to its own file of `run_dir`.
    `t` of every event is `clock() - started`: seconds since the run started, on the wall
    clock, which all processes on the host share."""

    def __init__(
        self,
        run_dir: str | Path,
        started: float,
        rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.started = started
        self.rank = rank
        self.clock = clock
        self.path = self.run_dir / (EVENTS if rank is None else f"events-rank{rank}.jsonl")
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def create(
        cls,
        run_dir: str | Path,
        scenario: str | Mapping[str, Any] | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.time,
        **fields: Any,
    ) -> RunWriter:
        """The parent's writer of a new run: makes `run_dir` (and `plots/`), writes
        `scenario.yaml` and the `run` line (name, start, `fields` such as the congestion
        control). Refuses a directory that already holds events."""
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / PLOTS).mkdir(exist_ok=True)
        existing = sorted(p.name for p in path.glob("events*.jsonl"))
        if existing:
            raise FileExistsError(f"{path} already holds a run ({', '.join(existing)})")
        if scenario is not None:
            text = scenario if isinstance(scenario, str) else yaml.safe_dump(
                dict(scenario), sort_keys=False)
            (path / SCENARIO).write_text(text)
        started = clock()
        writer = cls(path, started, None, clock)
        writer.event("run", t=0.0, name=name or path.resolve().name, started=started,
                     format=FORMAT, **fields)
        return writer

    @classmethod
    def open(
        cls, run_dir: str | Path, rank: int | None = None, started: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> RunWriter:
        """A writer for an existing run (a worker's, with its `rank`): the start is read from
        the `run` line of `events.jsonl` unless given."""
        path = Path(run_dir)
        if started is None:
            try:
                with (path / EVENTS).open("rb") as file:
                    first = json.loads(file.readline())
                started = float(first["started"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise RunError(f"{path / EVENTS}: no run line to take the start from "
                               f"({error}); was the run created with RunWriter.create?") from None
        return cls(path, started, rank, clock)

    def now(self) -> float:
        return self.clock() - self.started

    def event(self, type: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one event (`type`, `t`, `fields`) as one line; returns it."""
        record = {"type": type, "t": self.now() if t is None else float(t), **fields}
        line = (json.dumps(record, default=_json_default) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError(f"{self.path}: writer is closed")
            view = memoryview(line)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        return record

    def step(self, record: Any, drift: float | None = None, t: float | None = None,
             **fields: Any) -> dict[str, Any]:
        """A step of a worker from its `StepRecord` (usable as `train(on_step=writer.step)`);
        `drift`: this worker's parameter distance from the average, if measured; `fields`:
        further figures."""
        values = step_fields(record, drift)
        if drift is not None and not math.isfinite(float(drift)):
            values["drift"] = None
        return self.event("step", t=t, **values, **fields)

    def drift(self, step: int, drift: float) -> dict[str, Any]:
        """This worker's drift from the figures every worker swapped after `step`: written when
        they came, after the step's own event (the swap is off the training path); `load_run`
        puts it on that step."""
        return self.event("drift", rank=self.rank, step=step,
                          drift=float(drift) if math.isfinite(float(drift)) else None)

    def parameters(self, step: int, vector: np.ndarray) -> Path:
        """A worker's flat parameter vector after `step` (`metrics.dump_parameters`), written
        whole or not at all (`run.parameter_dumps` reads them back)."""
        folder = self.run_dir / PARAMETERS
        folder.mkdir(exist_ok=True)
        path = folder / f"rank{self.rank}-step{step}.npy"
        partial = path.with_suffix(".tmp")
        with partial.open("wb") as file:
            np.save(file, vector)
        partial.replace(path)
        return path

    def fault(self, action: str, scheduled: float | None = None, t: float | None = None,
              **fields: Any) -> dict[str, Any]:
        """A fault applied now (`action`: set, kill, restart, ...); `scheduled`: seconds since
        start it was due; `fields`: what it did (e.g. `link`, `rank`, `set`)."""
        return self.event("fault", t=t, action=action, scheduled=scheduled, **fields)

    def link(self, src: int | str, dst: int | str, configured_loss: float,
             measured_loss: float, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """A link measurement: loss as fractions (0.05 for 5%); `fields`: further figures, e.g.
        `configured_delay_ms`, `measured_delay_ms`, `probes`."""
        return self.event("link", t=t, src=src, dst=dst, configured_loss=float(configured_loss),
                          measured_loss=float(measured_loss), **fields)

    def end(self, success: bool, error: str | None = None, rank: int | None = None,
            t: float | None = None) -> dict[str, Any]:
        """A worker ended (its own writer, or the parent on its behalf with `rank`), or, from the
        parent without `rank`, the run."""
        return self.event("end", t=t, rank=self.rank if rank is None else rank,
                          success=bool(success), error=error)

    def finish(self, success: bool | None = None, error: str | None = None) -> dict[str, Any]:
        """The parent's last call: the run's end event, then `summary.json` from every events
        file; returns the summary. `success` None: no worker reported failure."""
        if success is None:
            success = not any(e.success is False for e in load_run(self.run_dir).ends)
        self.end(success, error)
        summary = write_summary(self.run_dir)
        self.close()
        return summary

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def write_summary(run_dir: str | Path) -> dict[str, Any]:
    """(Re)compute `summary.json` of `run_dir` from its events; returns it."""
    summary = summarize(load_run(run_dir))
    path = Path(run_dir) / SUMMARY
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    temporary.replace(path)
    return summary
