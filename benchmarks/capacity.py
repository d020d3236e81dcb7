"""Capacity: how many workers a host holds at a given step time (docs/multi-host.md).

Runs the quickstart's job (the MLP on digits, the lossy all-reduce, every link `loss: 1%`,
loss only so the host's fallback shapes it) as a namespace run (`ClusterRun`) with 2 to 32
workers on this host, one after the other, and reads each worker's step events: the run's
step time is, per step, the time from the last worker's previous step to its step (the
slowest worker sets the pace of a synchronous all-reduce), its median and 90th percentile over
the steps after a warm-up; beside it each worker's median compute and all-reduce time. Per step
time, the most workers per core that met it here. Writes benchmarks/results/capacity.md.

    .venv/bin/python -m benchmarks.capacity [--workers 2,4,8,16,32] [--steps 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.report import Run
from benchmarks.scale import scenario
from testbed.cluster.runner import ClusterRun

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "capacity.md"
WARMUP = 10  # steps left out at the start (first all-reduces, page faults, the deadline learning)
TARGETS = (0.01, 0.025, 0.05, 0.1)  # step times (seconds) the conclusion is given for


@dataclass
class Figures:
    """One worker count's run: seconds per step (the run's pace) and per worker."""

    workers: int
    steps: int
    success: bool
    step_median: float
    step_p90: float
    compute_median: float  # each worker's median compute, the median over workers
    allreduce_median: float
    seconds: float  # the whole run, from launch


def _paced(run_dir: Path, workers: int) -> tuple[list[float], list[float], list[float]]:
    """The run's step intervals after the warm-up (the slowest worker's), and each worker's
    median compute and all-reduce seconds."""
    last: dict[int, float] = {}
    computes, allreduces = [], []
    for rank in range(workers):
        events = [json.loads(line) for line in
                  (run_dir / f"events-rank{rank}.jsonl").read_text().splitlines()]
        steps = [e for e in events if e["type"] == "step" and e["step"] >= WARMUP]
        for event in steps:
            last[event["step"]] = max(last.get(event["step"], 0.0), event["t"])
        computes.append(statistics.median(e["compute_seconds"] for e in steps))
        allreduces.append(statistics.median(e.get("allreduce_seconds", 0.0) for e in steps))
    ordered = [last[step] for step in sorted(last)]
    return [b - a for a, b in itertools.pairwise(ordered)], computes, allreduces


def measure(workers: int, steps: int, root: Path) -> Figures:
    path = root / f"capacity-{workers}.yaml"
    data = scenario(workers, announced=False, steps=steps, collective="lossy")
    data["name"] = f"capacity-{workers}"
    path.write_text(yaml.safe_dump(data))
    run_dir = root / f"run-{workers}"
    begun = time.monotonic()
    result = ClusterRun(path, run_dir=run_dir).run()
    seconds = time.monotonic() - begun
    intervals, computes, allreduces = _paced(run_dir, workers)
    deciles = statistics.quantiles(intervals, n=10)
    return Figures(workers, steps, result.success, statistics.median(intervals), deciles[-1],
                   statistics.median(computes), statistics.median(allreduces), seconds)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def conclusion(figures: list[Figures], cores: int) -> list[str]:
    """Per target step time: the most workers per core whose run met it here."""
    lines = []
    for target in TARGETS:
        met = [f.workers for f in figures if f.success and f.step_median <= target]
        per_core = max(met, default=0) / cores
        lines.append(f"- Step time within {_ms(target)}: "
                     + (f"{max(met)} workers on {cores} cores, {per_core:g} per core."
                        if met else "no count measured met it."))
    return lines


def report(figures: list[Figures], run: Run, loads: tuple[str, str]) -> str:
    cores = os.cpu_count() or 1
    lines = [
        *run.header("Capacity: workers per core at a given step time",
                    also=f" Load average (1, 5, 15 min) at the start: {loads[0]}; at the end: "
                    f"{loads[1]} (the runs' own workers count in it, and so does any other job "
                    "on the machine)."),
        "The quickstart's job (MLP on digits, lossy all-reduce, batch 32, every link `loss: 1%`) "
        "as a namespace run on this host, one worker count after the other. `step` is the "
        "run's pace: per step, the time from the slowest worker's previous step to its step, "
        f"over the steps after the first {WARMUP}; `compute` and `all-reduce` are each "
        "worker's median, the median over workers. Workers forked from one zygote share "
        "torch's pages; a container's worker (Compose, Swarm) does not, but computes and "
        "communicates the same.",
        "",
        "| workers | workers per core | steps | step median | step p90 | compute | all-reduce "
        "| run | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        lines.append(f"| {f.workers} | {f.workers / cores:g} | {f.steps} | {_ms(f.step_median)} "
                     f"| {_ms(f.step_p90)} | {_ms(f.compute_median)} | "
                     f"{_ms(f.allreduce_median)} | {f.seconds:.1f} s | "
                     f"{'yes' if f.success else 'no'} |")
    lines += ["", "### Workers a host holds", "",
              "Per step time, the most workers whose run met it here, and per core. On "
              "another host the same command measures it; scaling by cores is an estimate, "
              "since the step time grows with the workers per core (they share the cores) "
              "and with the count (each all-reduce has more peers):", "",
              *conclusion(figures, cores), ""]
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_counts, default=[2, 4, 8, 16, 32],
                        help="worker counts (default 2,4,8,16,32)")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.steps <= WARMUP + 2:
        parser.error(f"--steps: more than {WARMUP + 2} (the first {WARMUP} are a warm-up)")
    run = Run.start("benchmarks.capacity")
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    figures = []
    with tempfile.TemporaryDirectory(prefix="tb-capacity-") as tmp:
        for workers in args.workers:
            measured = measure(workers, args.steps, Path(tmp))
            print(measured, file=sys.stderr, flush=True)
            figures.append(measured)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    loads = (load, " ".join(Path("/proc/loadavg").read_text().split()[:3]))
    args.out.write_text(report(figures, run, loads))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
