"""A user's DDP script over the testbed's collectives: plain gloo DDP against the ring, lossy and
lossy + INT8 communication hooks, on clean and lossy 100 Mbit/s links.

Every cell is one `testbed run` (`ClusterRun`) of a scenario whose job is the user-style script
`examples/ddp/train.py` (plain DDP) or `examples/ddp/train_lossy.py` (the same script with the
scenario's collective as DDP's communication hook): four workers, each a process in its own
network namespace. Two models (train.py's `--hidden`: about 0.1M and 10M parameters), four
networks (unshaped; 100 Mbit/s per downlink with 0%, 1% and 10% random loss: the host's
fallback shaping, htb and nftables random drop), four ways to all-reduce the gradients. The
figures: the mean step time after the warm-up steps (rank 0's own clock, from the script's
per-step lines) and its ratio to plain DDP's on the same network, the final training loss
(mean of the last steps'), and whether every replica ended identical.
Writes benchmarks/results/ddp-hook.md after every cell.

`--profile` says where the lossy hook's time goes: its cells run `benchmarks/ddp_hook_job.py`
(train.py with the same hook, rank 0 printing each call's phases: wall and CPU seconds, datagrams,
the time it queued behind earlier buckets), and two more ways measure what is not the network's:
`local` (a hook that hands the bucket back at once: computation and DDP's own work) and
`local-thread` (the same through the hook's thread and futures: the hand-offs).

    .venv/bin/python -m benchmarks.ddp_hook [--quick] [--models small,large]
        [--networks clean,100mbit,...] [--ways plain,ring,...] [--profile] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Run, partial
from benchmarks.scenario_runs import fmt, run_scenario, status_text
from testbed.cluster import zygote
from testbed.collectives.lossy import CALL_PHASES as PHASES

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp"
JOB = REPO / "benchmarks" / "ddp_hook_job.py"
RESULTS = REPO / "benchmarks" / "results" / "ddp-hook.md"
WORLD = 4
FEATURES, CLASSES = 32, 10  # train.py's synthetic task


def parameters(hidden: int) -> int:
    """train.py's model: Linear(FEATURES, hidden), ReLU, Linear(hidden, CLASSES)."""
    return (FEATURES + 1) * hidden + (hidden + 1) * CLASSES


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    steps: int
    lr: float  # SGD's step size: the 10M model's width diverges at the small one's 0.1
    timeout: float  # seconds for the run, start-up included

    @property
    def parameters(self) -> int:
        return parameters(self.hidden)


MODELS = {
    "small": Model("small", hidden=2325, steps=60, lr=0.1, timeout=240.0),
    "large": Model("large", hidden=232_558, steps=10, lr=0.001, timeout=480.0),
}
QUICK_STEPS = {"small": 12, "large": 4}
WARMUP = 2  # steps left out of the mean: DDP rebuilds its buckets after the first
LAST = 5  # steps whose training loss is averaged for the final loss
RATE = 100e6  # bits/s per downlink on the shaped networks
NETWORKS: dict[str, dict[str, Any]] = {
    "clean": {},
    "100mbit": {"rate": "100mbit"},
    "100mbit-1%": {"rate": "100mbit", "loss": "1%"},
    "100mbit-10%": {"rate": "100mbit", "loss": "10%"},
}
CLEAN = ("clean", "100mbit")  # where the lossy hook should cost at most TARGET_CLEAN x plain
TARGET_CLEAN = 1.2
WAYS = ("plain", "ring", "lossy", "lossy-parity-always", "lossy-int8")
LOCAL_WAYS = ("local", "local-thread")  # --profile's: the hook without a network


@dataclass(frozen=True)
class Cell:
    model: Model
    network: str
    way: str
    profile: bool = False  # lossy through ddp_hook_job.py, printing its calls

    @property
    def name(self) -> str:
        return f"{self.model.name}-{self.network.replace('%', 'pct')}-{self.way}"

    def scenario(self, steps: int) -> dict[str, Any]:
        """The scenario: the script as the job, the hook's collective as the scenario's."""
        script = ["train.py" if self.way == "plain" else "train_lossy.py"]
        if self.way in LOCAL_WAYS or (self.profile and self.way == "lossy"):
            script = [str(JOB), self.way]
        collective: dict[str, Any] = {"kind": "gloo"}
        if self.way == "ring":
            collective = {"kind": "ring"}
        elif self.way.startswith("lossy"):
            # paced at the link's rate where there is one (the sender's share of it)
            collective = {"kind": "lossy", "rate": RATE if NETWORKS[self.network] else None}
            if self.way == "lossy-int8":
                collective["compressor"] = {"kind": "int8"}
            if self.way == "lossy-parity-always":
                collective["parity_when"] = "always"
        topology: dict[str, Any] = {}
        if NETWORKS[self.network]:
            topology["default"] = NETWORKS[self.network]
        return {
            "name": f"ddp-hook-{self.name}", "workers": WORLD, "topology": topology,
            "job": {"command": ["python", *script, "--steps", str(steps),
                                "--hidden", str(self.model.hidden),
                                "--lr", str(self.model.lr)],
                    "cwd": str(EXAMPLE)},
            "collective": collective,
        }


@dataclass
class Outcome:
    cell: Cell
    status: str  # ok | timeout | failed
    steps: int = 0  # steps rank 0 finished
    step_seconds: float = math.nan
    final_loss: float = math.nan
    identical: bool | None = None  # every replica's checksum the same
    load: float = math.nan  # the 1-minute load average as the cell ended
    cpu: float = math.nan  # CPU seconds (user + system) of the cell's processes
    wall: float = math.nan
    note: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # --profile: rank 0's calls


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a worker's script printed (other lines skipped)."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            lines.append(value)
    return lines


def run_cell(cell: Cell, steps: int, workdir: Path) -> Outcome:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ran = run_scenario(cell.scenario(steps), cell.name, workdir, cell.model.timeout)
    zygote.close_idle()  # the run's zygote, kept for the next run, reaps its workers' CPU too
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the run, reaped
    outcome = Outcome(cell, ran.status, wall=ran.wall, note=ran.note,
                      load=os.getloadavg()[0],
                      cpu=after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    logs = workdir / cell.name / "logs"
    rank0 = read_lines(logs / "worker-0.stdout")
    per_step = [line for line in rank0 if "step" in line]
    outcome.calls = [line for line in rank0 if "call" in line]
    outcome.steps = len(per_step)
    times = [line["seconds"] for line in per_step]
    if len(times) > WARMUP + 1:
        outcome.step_seconds = (times[-1] - times[WARMUP]) / (len(times) - 1 - WARMUP)
    if per_step:
        outcome.final_loss = statistics.fmean(line["loss"] for line in per_step[-LAST:])
    checksums = {line["checksum"] for rank in range(WORLD)
                 for line in read_lines(logs / f"worker-{rank}.stdout") if "checksum" in line}
    if ran.status == "ok":
        outcome.identical = len(checksums) == 1
    return outcome


# -- the report ------------------------------------------------------------------------------

def way_of(outcomes: list[Outcome], cell: Cell, way: str) -> Outcome | None:
    return next((o for o in outcomes if o.cell.model == cell.model
                 and o.cell.network == cell.network and o.cell.way == way), None)


def ratio(outcome: Outcome, outcomes: list[Outcome]) -> float:
    """Step time over plain DDP's on the same model and network (nan without both)."""
    plain = way_of(outcomes, outcome.cell, "plain")
    if plain is None or not plain.step_seconds > 0:
        return math.nan
    return outcome.step_seconds / plain.step_seconds


def verdict(outcome: Outcome, outcomes: list[Outcome]) -> str:
    """The lossy hook's target on this network: within TARGET_CLEAN x plain where clean,
    faster than plain where lossy."""
    if outcome.cell.way != "lossy":
        return ""
    value = ratio(outcome, outcomes)
    if math.isnan(value):
        plain = way_of(outcomes, outcome.cell, "plain")
        if plain is not None and plain.status == "timeout" and outcome.status == "ok":
            return "PASS (plain timed out)"
        return "-"
    if outcome.cell.network in CLEAN:
        return f"{'PASS' if value <= TARGET_CLEAN else 'miss'} (<= {TARGET_CLEAN}x)"
    return f"{'PASS' if value < 1 else 'miss'} (< 1x)"


def table(outcomes: list[Outcome]) -> list[str]:
    rows = ["| model | network | way | steps | step s | vs plain | target | final loss "
            "| replicas | load | CPU s | status |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        value = ratio(o, outcomes)
        replicas = {True: "identical", False: "differ", None: "-"}[o.identical]
        rows.append(
            f"| {o.cell.model.name} ({o.cell.model.parameters / 1e6:.2g}M) | {o.cell.network} "
            f"| {o.cell.way} | {o.steps} | {fmt(o.step_seconds)} "
            f"| {'-' if math.isnan(value) else f'{value:.2f}x'} | {verdict(o, outcomes)} "
            f"| {fmt(o.final_loss, 4)} | {replicas} | {o.load:.1f} | {fmt(o.cpu)} "
            f"| {status_text(o)} |")
    return rows


def observations(outcomes: list[Outcome]) -> list[str]:
    """Sentences computed from this run: the targets met and missed."""
    lossy = [o for o in outcomes if o.cell.way == "lossy"]
    met = [o for o in lossy if verdict(o, outcomes).startswith("PASS")]
    missed = [o for o in lossy if verdict(o, outcomes).startswith("miss")]
    text = [f"The lossy hook met its target in {len(met)} of {len(lossy)} cells."]
    for o in missed:
        text.append(f"Missed: {o.cell.model.name} on {o.cell.network}, "
                    f"{ratio(o, outcomes):.2f}x plain DDP's step.")
    return text


@dataclass
class Profile:
    """A lossy cell's calls on rank 0, per step after the warm-up: sums over the step's calls."""

    outcome: Outcome
    steps: int
    calls: float
    seconds: float  # the calls' wall time
    queued: float  # behind earlier buckets, from DDP's hand-over to the call's start
    phases: dict[str, tuple[float, float]]  # wall, CPU
    datagrams: float  # sent and read

    @property
    def cpu(self) -> float:
        return sum(cpu for _, cpu in self.phases.values())

    @property
    def cpu_per_datagram(self) -> float:
        """This thread's CPU in the phases that move datagrams, per datagram sent or read."""
        moving = sum(self.phases[p][1] for p in PHASES if p.endswith(("_send", "_wait")))
        return moving / self.datagrams if self.datagrams else math.nan


def profile_of(outcome: Outcome) -> Profile | None:
    calls = [c for c in outcome.calls if c["in_step"] >= WARMUP]
    steps = len({c["in_step"] for c in calls})
    if not steps:
        return None
    phases = {p: (sum(c["phases"].get(p, (0.0, 0.0))[0] for c in calls) / steps,
                  sum(c["phases"].get(p, (0.0, 0.0))[1] for c in calls) / steps)
              for p in PHASES}
    return Profile(outcome, steps, len(calls) / steps,
                   sum(c["seconds"] for c in calls) / steps,
                   sum(c["queued"] for c in calls) / steps, phases,
                   sum(c["datagrams_sent"] + c["datagrams_received"] for c in calls) / steps)


def ms(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value * 1e3:.1f}"


def step_of(outcomes: list[Outcome], cell: Cell, way: str) -> float:
    other = way_of(outcomes, cell, way)
    return other.step_seconds if other is not None else math.nan


def profile_tables(profiles: list[Profile], outcomes: list[Outcome]) -> list[str]:
    """Step times beside what is not the network's, then the lossy calls' phases."""
    rows = ["| model | network | plain ms | local ms | local-thread ms | lossy ms "
            "| calls/step | calls ms | of which CPU | queued ms | datagrams/step "
            "| CPU us/datagram |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in profiles:
        cell = p.outcome.cell
        rows.append(
            f"| {cell.model.name} | {cell.network} | {ms(step_of(outcomes, cell, 'plain'))} "
            f"| {ms(step_of(outcomes, cell, 'local'))} "
            f"| {ms(step_of(outcomes, cell, 'local-thread'))} | {ms(p.outcome.step_seconds)} "
            f"| {p.calls:.1f} | {ms(p.seconds)} | {ms(p.cpu)} | {ms(p.queued)} "
            f"| {p.datagrams:,.0f} | {fmt(p.cpu_per_datagram * 1e6)} |")
    rows += ["", "Per phase of the lossy calls, ms a step: wall / this thread's CPU.", "",
             "| model | network | " + " | ".join(PHASES) + " |",
             "| --- | --- | " + " | ".join("---" for _ in PHASES) + " |"]
    for p in profiles:
        rows.append(f"| {p.outcome.cell.model.name} | {p.outcome.cell.network} | "
                    + " | ".join(f"{ms(w)} / {ms(c)}" for w, c in p.phases.values()) + " |")
    return rows


def profile_observations(profiles: list[Profile], outcomes: list[Outcome]) -> list[str]:
    """Per profiled cell, where the lossy calls' time went (from this run)."""
    text = []
    for p in profiles:
        cell = p.outcome.cell
        sends = sum(p.phases[name][1] for name in PHASES if name.endswith("_send"))
        largest = max(p.phases, key=lambda name: p.phases[name][0])
        text.append(
            f"{cell.model.name} on {cell.network}: the lossy step took "
            f"{ms(p.outcome.step_seconds)} ms against plain DDP's "
            f"{ms(step_of(outcomes, cell, 'plain'))} ms and "
            f"{ms(step_of(outcomes, cell, 'local-thread'))} ms with the same thread and no "
            f"network; its {p.calls:.1f} calls a step ran {ms(p.seconds)} ms on the hook's "
            f"thread: {ms(p.cpu)} ms that thread's CPU ({ms(sends)} ms of it in the sends; "
            f"{fmt(p.cpu_per_datagram * 1e6)} us per datagram sent or read, "
            f"{p.datagrams:,.0f} a step), {ms(p.seconds - p.cpu)} ms waiting (pacing, the "
            f"peers, the scheduler); the longest phase was {largest} "
            f"({ms(p.phases[largest][0])} ms wall, {ms(p.phases[largest][1])} ms CPU); buckets "
            f"waited {ms(p.queued)} ms a step for the thread (hand-off and earlier buckets).")
    return text


def report(outcomes: list[Outcome], run: Run, steps: dict[str, int], note: str = "") -> str:
    models = ", ".join(f"{m.name}: `--hidden {m.hidden}`, {m.parameters:,} parameters, "
                       f"SGD lr {m.lr:g}, {steps[m.name]} steps"
                       for m in MODELS.values() if m.name in steps)
    return "\n".join([
        *run.header("A user's DDP script: plain gloo DDP against the testbed's collectives as "
                    "its hook", note),
        f"How: every cell is one `ClusterRun` of a scenario written by the benchmark, {WORLD} "
        "workers, each a process in its own network namespace on the lab's bridge, running "
        "`examples/ddp/train.py` (plain: DDP over torch.distributed gloo, TCP cubic, the "
        "namespaces' default) or `examples/ddp/train_lossy.py` (the same script with "
        "`register_comm_hook(state=None, hook=scenario_hook())`: the scenario's collective "
        "moves the gradients, gloo only DDP's bookkeeping). Models: a 2-layer MLP on a "
        f"synthetic task, batch 64 per worker; {models}. Networks: `clean` is "
        "unshaped; `100mbit` is htb at 100 Mbit/s on every host's downlink, `-1%`/`-10%` add "
        "nftables random drop on every receiver (this kernel has no sch_netem). Ways: `plain`, "
        "`ring` (the ring hook over TCP), `lossy` (paced at 100 Mbit/s where the links have a "
        "rate, unpaced on `clean`; its other options the defaults: parity only to peers that "
        "lost some of a broadcast lately), `lossy-parity-always` (lossy with parity to every "
        "peer every call, the default before), `lossy-int8` (lossy with "
        "the INT8 compressor, whose two-step all-reduce travels on lossy's TCP mesh, not its "
        "datagrams: quantized bytes are not self-describing per datagram, so under loss it pays "
        "what TCP pays).",
        "",
        f"Columns: `step s` is rank 0's mean step time after {WARMUP} warm-up steps (its own "
        "clock, from the script's per-step lines); `vs plain` that over plain DDP's on the "
        f"same model and network; `target` the lossy hook's: at most {TARGET_CLEAN}x plain "
        "where the network is clean, faster than plain where packets are lost; `final loss` "
        f"rank 0's training loss, mean of the last {LAST} steps; `replicas` whether every "
        "worker's parameters ended bit-identical (lossy under loss lets them differ where a "
        "broadcast chunk was missed); `load` the 1-minute load average as the cell ended "
        "(2 cores: above 2, the cell shared the CPU with more than its own work); `CPU s` the "
        "user and system CPU seconds of the cell's processes (the zygote, the workers, their "
        "scripts; start-up included; the kernel's packet work in softirq only where it ran "
        "on their time).",
        "",
        *table(outcomes),
        "",
        "## Observations (generated from this run's numbers)",
        "",
        " ".join(observations(outcomes)),
        "",
        *profile_section(outcomes),
    ])


def profile_section(outcomes: list[Outcome]) -> list[str]:
    profiles = [p for o in outcomes if o.calls and (p := profile_of(o)) is not None]
    if not profiles:
        return []
    return [
        "## Where a lossy hook call's time goes (--profile)",
        "",
        f"Rank 0's calls after {WARMUP} warm-up steps, summed per step. `local` is the same "
        "script with a hook that hands DDP each bucket back at once (the computation and DDP's "
        "own work, no communication); `local-thread` the same through the hook's thread and "
        "futures. Without communication nothing keeps the ranks together: four processes run "
        "free on two cores, so these steps are the scheduler's (a rerun of the small model's "
        "`local` cell had steps from 1 to 108 ms), a floor for the large model, noise for the "
        "small. `calls ms` the hook thread's time in "
        "the collective, `of which CPU` that thread's own CPU (Python, per-datagram system "
        "calls, copies: `time.thread_time`), the rest waiting (pacing, the peers, and on this "
        "2-core host the scheduler: four workers share two cores); `queued` how long buckets "
        "waited for the hook's thread (the hand-off, and earlier buckets' calls); "
        "`CPU us/datagram` the CPU of the send and wait phases per "
        "datagram sent or read.",
        "",
        *profile_tables(profiles, outcomes),
        "",
        "### Observations (generated from this run's numbers)",
        "",
        *(f"- {line}" for line in profile_observations(profiles, outcomes)),
        "",
    ]


def plan(models: list[str], networks: list[str], ways: list[str], profile: bool) -> list[Cell]:
    return [Cell(MODELS[m], n, w, profile) for m in models for n in networks for w in ways]


def split(value: str, allowed: tuple[str, ...] | list[str], flag: str,
          parser: argparse.ArgumentParser) -> list[str]:
    chosen = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}: expected some of {', '.join(allowed)}, got {value!r}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp_hook",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per cell")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--ways", default=None,
                        help=f"default: {','.join(WAYS)}; with --profile "
                             f"plain,{','.join(LOCAL_WAYS)},lossy")
    parser.add_argument("--profile", action="store_true",
                        help="where the lossy hook's time goes (its calls' phases)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    models = split(args.models, list(MODELS), "--models", parser)
    networks = split(args.networks, list(NETWORKS), "--networks", parser)
    ways = split(args.ways or (f"plain,{','.join(LOCAL_WAYS)},lossy" if args.profile
                               else ",".join(WAYS)),
                 (*WAYS, *LOCAL_WAYS), "--ways", parser)
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and shaping")
    steps = {m: (QUICK_STEPS[m] if args.quick else MODELS[m].steps) for m in models}
    run = Run.start("benchmarks.ddp_hook")
    cells = plan(models, networks, ways, args.profile)
    outcomes: list[Outcome] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tb-ddp-hook-") as tmp:
        for number, cell in enumerate(cells, start=1):
            outcome = run_cell(cell, steps[cell.model.name], Path(tmp))
            outcomes.append(outcome)
            print(f"{run.progress(number, len(cells))} "
                  f"{cell.name}: {outcome.status}, step {fmt(outcome.step_seconds)} s, "
                  f"loss {fmt(outcome.final_loss, 4)}, load {outcome.load:.1f} {outcome.note}",
                  file=sys.stderr, flush=True)
            args.out.write_text(report(outcomes, run, steps, note=partial(number, len(cells))))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
