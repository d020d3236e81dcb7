"""Where a run's time goes before its first step and after its last: the quickstart in the
User-Mode Linux guest (this host's kernel has no sch_netem, so `testbed run` starts one), and the
same run on this host's kernel without its delay (the fallback shapes loss alone).

Each run is `testbed run SCENARIO -o DIR --json`, the documented command, in a subprocess; its
wall time is the user's. The run's own records give the rest, on the run's clock (seconds since
its directory was made, in the guest where it runs there): the namespaces up (`cluster`), each
worker's stages (`startup`: its process entered, scenario loaded, collective connected, job
built, ready past the start barrier; the median over the workers), the first and last step
(the first worker's first step event and the last worker's last), and the run's `end`. What the
wall time holds beyond the run's own clock is the CLI's start, the guest's boot and exit, and the
report's plots (drawn on this host once the guest is done). The zygote's imports, the largest
span in the guest, are then timed one module at a time in a fresh guest; and two runs one after
the other in one process in a guest (as a test suite or a sweep runs them) show what a run
costs once its process has a zygote (*warm*; wall: the run's own, from its `ClusterRun`).

Writes benchmarks/results/startup.md, with the targets of the fast-loops work: the first step
within 8 s of the cluster being up, and the guest's whole quickstart under 20 s.

    .venv/bin/python -m benchmarks.startup [--runs 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.report import Run
from testbed.report import load_run
from testbed.scenario.load import SHIPPED

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "startup.md"
STAGES = ("entered", "loaded", "connected", "built", "ready")
FIRST_STEP_TARGET = 8.0  # seconds from the cluster up to the first step
GUEST_WALL_TARGET = 20.0  # seconds of the whole quickstart in the guest


@dataclass(frozen=True)
class Timing:
    """One run's times: `wall` the command's, the rest on the run's clock."""

    where: str
    wall: float
    cluster: float
    stages: dict[str, float]  # the median over the workers of each stage
    first_step: float
    last_step: float
    end: float
    success: bool

    @property
    def outside(self) -> float:
        """The wall time beyond the run's own clock: the guest's boot and exit, the CLI."""
        return self.wall - self.end


def host_variant(scenario: Path, into: Path) -> Path:
    """The scenario without its links' delay, which this host's kernel cannot shape."""
    spec = yaml.safe_load(scenario.read_text())
    spec["topology"]["default"].pop("delay", None)
    spec["name"] = f"{spec['name']}-host"
    path = into / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_once(scenario: Path, out: Path, sandbox: str) -> Timing:
    begun = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "testbed.cli", "run", str(scenario), "-o", str(out), "--json",
         "--sandbox", sandbox], capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - begun
    if not (out / "events.jsonl").exists():
        raise SystemExit(f"no run directory (exit {result.returncode}):\n"
                         f"{result.stderr[-4000:]}")
    summary = out / "summary.json"
    success = result.returncode == 0 and summary.exists() and bool(
        json.loads(summary.read_text()).get("success"))
    return read_timing(out, "guest" if sandbox == "uml" else "host", wall, success)


IMPORTS = """
import importlib, json, time
from testbed.cluster.zygote import PRELOAD
took = {}
for name in PRELOAD:
    begun = time.monotonic()
    importlib.import_module(name)
    took[name] = time.monotonic() - begun
print("IMPORTS " + json.dumps(took))
"""


def in_guest(code: str, *args: str, marker: str, what: str, timeout: float) -> list[str]:
    """Run `python -c CODE ARGS` in a fresh guest (4 GiB, as `testbed run` gives one); the
    words after `marker` on each line of its output that starts with it."""
    result = subprocess.run(
        [sys.executable, "-m", "testbed.cli", "sandbox", "run", "--mem", "4G", "--",
         sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO)
    found = [line.removeprefix(marker).strip() for line in result.stdout.splitlines()
             if line.startswith(marker)]
    if result.returncode != 0 or not found:
        raise SystemExit(f"{what} in the guest failed (exit {result.returncode}):\n"
                         f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return found


def guest_imports() -> dict[str, float]:
    """Seconds each of the zygote's imports takes in a fresh guest, in the zygote's order."""
    [line] = in_guest(IMPORTS, marker="IMPORTS ", what="the zygote's imports", timeout=600)
    return json.loads(line)


TWO_RUNS = """
import sys, time
from testbed.cluster.runner import ClusterRun
for out in sys.argv[2:]:
    begun = time.monotonic()
    result = ClusterRun(sys.argv[1], run_dir=out, report=False).run()
    print(f"RUN {out} {time.monotonic() - begun} {int(result.success)}", flush=True)
"""


def runs_in_one_guest_process(scenario: Path, outs: list[Path]) -> list[Timing]:
    """`outs` runs of `scenario` one after the other in one process in a guest: the first
    starts a zygote (*cold*), the others take it (*warm*)."""
    done = [line.split() for line in in_guest(
        TWO_RUNS, str(scenario), *map(str, outs), marker="RUN ",
        what="the runs in one process", timeout=1800)]
    if len(done) != len(outs):
        raise SystemExit(f"the runs in one process in the guest: {len(done)} of {len(outs)} "
                         "ended")
    return [read_timing(Path(out), "guest, cold" if index == 0 else "guest, warm",
                        float(wall), success == "1")
            for index, (out, wall, success) in enumerate(done)]


def read_timing(run_dir: Path, where: str, wall: float, success: bool) -> Timing:
    """A run directory's times (its `cluster`, `startup`, step and `end` records)."""
    run = load_run(run_dir)
    startups = [event for event in run.other if event["type"] == "startup"]
    ranks = {s.rank for s in run.steps}
    return Timing(
        where=where, wall=wall,
        cluster=next(event["t"] for event in run.other if event["type"] == "cluster"),
        stages={stage: statistics.median(event[stage] for event in startups) for stage in STAGES},
        first_step=min(min(s.t for s in run.steps if s.rank == rank) for rank in ranks),
        last_step=max(s.t for s in run.steps), end=next(e.t for e in run.ends if e.rank is None),
        success=success)


def row(t: Timing) -> str:
    since = t.first_step - t.cluster
    stages = " | ".join(f"{t.stages[stage]:.1f}" for stage in STAGES)
    return (f"| {t.where} | {t.wall:.1f} | {t.outside:.1f} | {t.cluster:.1f} | {stages} | "
            f"{t.first_step:.1f} | {since:.1f} | {t.last_step - t.first_step:.1f} | "
            f"{t.end - t.last_step:.1f} | {t.end:.1f} | {'yes' if t.success else 'NO'} |")


def spans(t: Timing) -> dict[str, float]:
    """The run's wall time in consecutive spans, each named by what fills it."""
    marks = [t.cluster, *(t.stages[stage] for stage in STAGES), t.first_step]
    names = ["cluster up until the workers entered (the zygote's imports)",
             *(f"{a} until {b}" for a, b in itertools.pairwise(STAGES)),
             "ready until the first step done"]
    between = zip(names, itertools.pairwise(marks), strict=True)
    return {"outside the run's clock": t.outside,
            "the run's start until the cluster was up": t.cluster,
            **{name: b - a for name, (a, b) in between},
            "training": t.last_step - t.first_step, "after the last step": t.end - t.last_step}


def verdicts(timings: list[Timing]) -> list[str]:
    """The two targets, met or missed, from this run's medians, and the largest spans."""
    said = []
    for where in ("guest", "host", "guest, warm"):
        cell = [t for t in timings if t.where == where]
        if not cell:
            continue
        medians = {name: statistics.median(spans(t)[name] for t in cell) for name in spans(cell[0])}
        largest = sorted(medians.items(), key=lambda item: -item[1])[:3]
        said.append(f"- {where}: the largest spans (medians): " + "; ".join(
            f"{name} {seconds:.1f} s" for name, seconds in largest) + ".")
        since = statistics.median(t.first_step - t.cluster for t in cell)
        said.append(f"- {where}: first step {since:.1f} s after the cluster was up (median of "
                    f"{len(cell)}): target {FIRST_STEP_TARGET:.0f} s "
                    f"{'met' if since <= FIRST_STEP_TARGET else 'missed'}.")
        if where == "guest":
            wall = statistics.median(t.wall for t in cell)
            said.append(f"- guest: the whole quickstart took {wall:.1f} s (median): target "
                        f"{GUEST_WALL_TARGET:.0f} s "
                        f"{'met' if wall < GUEST_WALL_TARGET else 'missed'}.")
    return said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs in each place (default 2)")
    parser.add_argument("--scenario", default="quickstart")
    args = parser.parse_args()
    run = Run.start("benchmarks.startup")
    scenario = SHIPPED / f"{args.scenario}.yaml"
    timings: list[Timing] = []
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        host = host_variant(scenario, Path(work))
        for index in range(args.runs):
            for path, sandbox in ((scenario, "uml"), (host, "none")):
                timings.append(run_once(path, Path(work) / f"{sandbox}-{index}", sandbox))
                print(row(timings[-1]), flush=True)
        one_process = runs_in_one_guest_process(
            scenario, [Path(work) / f"one-process-{index}" for index in range(2)])
        timings += one_process
        for timing in one_process:
            print(row(timing), flush=True)
    imports = guest_imports()
    stages = " | ".join(STAGES)
    RESULTS.write_text("\n".join([
        *run.header(f"Where `testbed run {args.scenario}` spends its time, in the guest and on "
                    "this host"),
        "Seconds. *wall*: the command's (*guest, cold* and *guest, warm*: two runs one after "
        "the other in one process in a guest, the first starting the zygote, the second taking "
        "it; their wall is the run's own `ClusterRun.run`, without a report); *outside*: wall "
        "minus the run's end (the CLI's start, the guest's boot and exit, the report's plots, "
        "drawn on this host); every other column on the run's own "
        "clock (0: its directory made): *cluster* the namespaces up; "
        f"*{stages}*: each worker's start-up stages (docs/report.md, `startup`), the median over "
        "the workers; *first step* the first worker's first step done; *since cluster* first "
        "step minus cluster; *training* last step minus first; *after* the run's end minus the "
        "last step; *end* the run's end. Host: the scenario without its delay (this kernel "
        "has no netem; the fallback shapes the loss).", "",
        f"| where | wall | outside | cluster | {stages} | first step | since cluster | "
        "training | after | end | success |",
        "|---|" + "---:|" * (8 + len(STAGES)) + "---|",
        *(row(t) for t in timings), "",
        *verdicts(timings),
        f"- guest: the zygote's imports one at a time in a fresh guest, "
        f"{sum(imports.values()):.1f} s in all: " + "; ".join(
            f"{name} {seconds:.1f} s" for name, seconds in imports.items()) + ".", ""]))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
