"""DiLoCo benchmark: synchronous DDP against DiLoCo, Streaming DiLoCo and parameter averaging, on
four workers training the char-level LM over three networks and several collectives.

Methods (the job's strategy): `ddp` (strategy gradient: every step an all-reduce of the
gradients), `diloco-h10` and `diloco-h50` (DiLoCo, H = 10 and 50), `streaming` (Streaming
DiLoCo: H = 50, five fragments, the all-reduces overlapped with the inner steps, outer gradients
in int4) and `average` (local steps, the parameters averaged every 10 steps), all with the same
inner optimizer (AdamW) and data; `torchft-h50`, the outside reference, is torchft's DiLoCo
(H = 50) on the same model, data and seed, as a command job (examples/torchft/train_diloco.py,
its own gloo process group: the cells' collective `torchft`; it needs the `torchft` extra).
Networks: `clean` (unshaped), `100mbit-20ms` and `10mbit-50ms-1%` on every link (a delay needs
sch_netem: where the kernel has none, run the benchmark in the UML sandbox, `python -m
netem.sandbox run --timeout 14400 --mem 4G -- .venv/bin/python -m benchmarks.diloco`; here such
cells are skipped, not recorded). Collectives: gloo, the ring and lossy for every method, and
Moshpit for `average` and DiLoCo. Every cell is one `ClusterRun` (namespaces) per seed; the
figures: held-out perplexity after the last step (equal inner steps), bytes each worker sent,
the wall-clock from the start of training until the workers' mean held-out perplexity first
reached DDP's final one (same network, collective and seed; Moshpit's cells against the ring's
DDP, torchft's against gloo's), and the longest wait of an inner step for an outer all-reduce.
The issue's targets are checked from the run's own numbers, and torchft's perplexity against
`diloco-h50` over gloo.

The whole benchmark takes many hours here (DDP's 500 steps on the slow network alone: ~50 min a
cell in the guest), so it is run in parts: every finished cell is kept as its own record
(`diloco-cells/NAME.json` beside the results file: the figures, and the command, date and
machine that produced them), `--resume` runs only the cells not recorded yet, and after every
cell benchmarks/results/diloco.md is rewritten from all the records. Processes with disjoint
cells can run at once (two guests: one per network) and share the records.

    .venv/bin/python -m benchmarks.diloco [--quick] [--steps N] [--seeds 11,12,..]
        [--networks N,..] [--methods M,..] [--collectives C,..] [--timeout S] [--resume]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import machine
from benchmarks.report import Run
from benchmarks.scenario_runs import fmt, run_scenario, status_text

if TYPE_CHECKING:
    import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "diloco.md"
WORLD = 4
SEEDS = (11, 12, 13)
STEPS, QUICK_STEPS = 500, 60
EVAL_EVERY, QUICK_EVAL_EVERY = 25, 20  # held-out evaluations: the curve the wall-clock reads
# Seconds per run, start-up included: DDP's 500 steps over TCP on the slow network take ~50 min
# in the guest (TCP's throughput at 1% loss and a 100 ms round trip, ~1.4 Mbit/s).
TIMEOUT, QUICK_TIMEOUT = 7200.0, 300.0
JOB = {"model": "char-lm", "batch": 32, "optimizer": {"adamw": {"lr": 3.0e-3}},
       "eval_samples": 512}
NETWORKS: dict[str, dict[str, str]] = {
    "clean": {},
    "100mbit-20ms": {"rate": "100mbit", "delay": "20ms"},
    "10mbit-50ms-1%": {"rate": "10mbit", "delay": "50ms", "loss": "1%"},
}
SLOW_NETWORK = "10mbit-50ms-1%"  # where DiLoCo H=50 must beat DDP's wall-clock three times
# There DiLoCo H=50 trains on past the equal steps, to REACH times them: behind DDP at equal
# steps, it reaches DDP's final perplexity later, and the target is the wall-clock to it.
REACH = 4
METHODS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "gradient"},
    "diloco-h10": {"strategy": "diloco", "inner_steps": 10},
    "diloco-h50": {"strategy": "diloco", "inner_steps": 50},
    "streaming": {"strategy": "diloco", "inner_steps": 50,
                  "streaming": {"fragments": 5, "overlap": True}},
    "average": {"strategy": "average", "average_every": 10},
    "torchft-h50": {},  # a command job: `Cell.scenario`
}
TORCHFT, TORCHFT_INNER_STEPS = "torchft-h50", 50
TORCHFT_SCRIPT = REPO / "examples" / "torchft" / "train_diloco.py"
COMPRESSOR = {"streaming": "int4"}  # the paper's 4-bit outer gradients
COLLECTIVES = ("gloo", "ring", "lossy", "moshpit", "torchft")
MOSHPIT_METHODS = ("average", "diloco-h10", "diloco-h50")
# Moshpit leaves out a peer not there in time: a call on the slow network needs longer than
# its 5 s default.
COLLECTIVE_OPTIONS = {"moshpit": {"timeout": 60.0}}
# The targets.
WITHIN = 3.0  # percent: DiLoCo H=50's perplexity against DDP's at equal steps
FEWER_BYTES = 40.0  # times fewer bytes than DDP
WALL_SHARE = 1 / 3  # of DDP's wall-clock on the slow network


@dataclass(frozen=True)
class Cell:
    network: str
    method: str
    collective: str
    seed: int

    @property
    def name(self) -> str:
        network = self.network.replace("%", "pct")
        return f"{self.method}-{self.collective}-{network}-seed{self.seed}"

    def steps_run(self, steps: int) -> int:
        """The steps this cell trains, `steps` being the equal steps all cells are compared at:
        REACH times them for DiLoCo H=50 on the slow network (figures read at `steps` too)."""
        return steps * REACH if (self.method, self.network) == ("diloco-h50",
                                                                  SLOW_NETWORK) else steps

    def scenario(self, steps: int, eval_every: int) -> dict[str, Any]:
        """The scenario, as the YAML the runner loads."""
        profile = NETWORKS[self.network]
        common = {"name": f"diloco-{self.name}", "seed": self.seed, "workers": WORLD,
                  "topology": {"default": profile} if profile else {}}
        if self.method == TORCHFT:  # the job's settings as the script's flags
            return {**common, "job": {"command": [
                "python", str(TORCHFT_SCRIPT), "--steps", str(steps), "--inner-steps",
                str(TORCHFT_INNER_STEPS), "--batch", str(JOB["batch"]),
                "--lr", str(JOB["optimizer"]["adamw"]["lr"]), "--eval-every", str(eval_every),
                "--eval-samples", str(JOB["eval_samples"])]}}
        job = {**JOB, **METHODS[self.method], "steps": steps, "eval_every": eval_every}
        collective: dict[str, Any] = {"kind": self.collective,
                                      **COLLECTIVE_OPTIONS.get(self.collective, {})}
        if self.method in COMPRESSOR:
            collective["compressor"] = {"kind": COMPRESSOR[self.method]}
        return {**common, "job": job, "collective": collective, "metrics": {"drift_every": 0}}


@dataclass
class Outcome:
    cell: Cell
    status: str  # ok | failed | timeout | skipped
    note: str = ""
    # At the equal steps (the last but where the cell ran on, `Cell.steps_run`):
    perplexity: float = math.nan  # held-out, mean over workers
    bytes_sent: float = math.nan  # per worker, since the start (NaN: the collective counts none)
    training_seconds: float = math.nan  # from the start of training
    outer_wait: float = math.nan  # the longest wait of a step for outer all-reduces
    # (seconds since the start of training, mean held-out perplexity) at each evaluation
    curve: list[tuple[float, float]] = field(default_factory=list)
    steps_run: int = 0  # the steps trained (0: a record from before cells ran on)
    outer_call: float = math.nan  # the longest outer all-reduce (a step's several added up)
    worker_lag: float = math.nan  # the largest gap between the workers' ends of one step

    def trained(self, steps: int) -> int:
        """The steps it trained, `steps` being the equal ones (all a record from before ran)."""
        return self.steps_run or steps


@dataclass
class Record:
    """A finished cell as kept on disk: its outcome, the run's length, and what produced it."""

    outcome: Outcome
    steps: int
    eval_every: int
    started: str  # when the process that ran it started, ISO 8601 UTC
    seconds: float  # how long that process had run when it wrote the record
    written_by: str  # that process's `machine.written_by` sentence then

    def save(self, directory: Path) -> None:
        """Write it as `directory/CELL.json`, whole or not at all (a run may stop any time)."""
        path = directory / f"{self.outcome.cell.name}.json"
        partial_path = path.with_suffix(".part")
        partial_path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        partial_path.replace(path)

    @classmethod
    def load(cls, path: Path) -> Record:
        data = json.loads(path.read_text())
        outcome = data.pop("outcome")
        outcome["cell"] = Cell(**outcome["cell"])
        outcome["curve"] = [tuple(point) for point in outcome["curve"]]
        return cls(Outcome(**outcome), **data)


def records_dir(out: Path) -> Path:
    """Where the records of the results file `out` live: `NAME-cells/` beside it."""
    return out.with_name(f"{out.stem}-cells")


def load_records(directory: Path) -> list[Record]:
    """Every record in `directory`, in the order of the full plan (DDP first per network)."""
    order = {name: i for i, name in enumerate([*NETWORKS, *METHODS, *COLLECTIVES])}
    records = [Record.load(path) for path in directory.glob("*.json")]
    return sorted(records, key=lambda r: (order[r.outcome.cell.network],
                                          r.outcome.cell.method != "ddp",
                                          order[r.outcome.cell.method],
                                          order[r.outcome.cell.collective], r.outcome.cell.seed))


def finite_max(values: np.ndarray) -> float:
    """The largest finite value (NaN marks the steps a figure is missing from); NaN if none."""
    import numpy as np

    return float(np.nanmax(values)) if np.isfinite(values).any() else math.nan


def largest_lag(steps: np.ndarray, times: np.ndarray) -> float:
    """The largest spread of `times` (the workers' step events) among those of one step number:
    how far the workers drifted apart, which an overlapped outer all-reduce must absorb."""
    import numpy as np

    if not len(steps):
        return math.nan
    order = np.lexsort((times, steps))
    steps, times = steps[order], times[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    return float(np.max(np.maximum.reduceat(times, starts) - np.minimum.reduceat(times, starts)))


def recorded(records: list[Record], steps: int) -> set[Cell]:
    """The cells `--resume` need not run again: recorded, not skipped, and trained as far as the
    cell trains now (a record from before a cell ran on counts its equal steps)."""
    return {r.outcome.cell for r in records if r.outcome.status != "skipped"
            and r.outcome.trained(r.steps) == r.outcome.cell.steps_run(steps)}


def run_cell(cell: Cell, steps: int, eval_every: int, timeout: float,
             workdir: Path) -> Outcome:
    """Run the cell's scenario within `timeout` and read its figures from the run."""
    import numpy as np

    if cell.method == TORCHFT and importlib.util.find_spec("torchft") is None:
        return Outcome(cell, "skipped", "torchft is not installed: pip install -e '.[torchft]'")
    steps_run = cell.steps_run(steps)
    ran = run_scenario(cell.scenario(steps_run, eval_every), cell.name, workdir, timeout)
    outcome = Outcome(cell, ran.status, ran.note, steps_run=steps_run)
    if cell.method == TORCHFT:
        return read_command_job(outcome, workdir / cell.name)
    run = ran.run
    if run is None or not run.steps:
        return outcome
    start = run.training_t if run.training_t is not None else min(s.t for s in run.steps)
    numbers = run.column("step")
    equal = numbers < steps  # the steps up to the equal ones (numbered from 0)
    times = run.column("t")[equal]
    sent = float(np.nansum(run.column("bytes_sent", 0.0)[equal])) / WORLD
    outcome.bytes_sent = sent if sent > 0 else math.nan  # gloo's stats count no bytes
    outcome.training_seconds = float(times.max()) - start
    outcome.outer_wait = finite_max(run.column("outer_wait_seconds")[equal])
    outcome.outer_call = finite_max(
        run.column("allreduce_seconds")[equal & (run.column("outer_updates", 0.0) > 0)])
    outcome.worker_lag = largest_lag(numbers[equal], times)
    evaluated: dict[int, list[tuple[float, float]]] = {}
    for step in run.steps:
        if "perplexity" in step.evaluation:
            evaluated.setdefault(step.step, []).append((step.t, step.evaluation["perplexity"]))
    outcome.curve = [(max(t for t, _ in points) - start,
                      statistics.fmean(p for _, p in points))
                     for _, points in sorted(evaluated.items()) if len(points) == WORLD]
    if ran.status == "ok" and steps_run > steps:  # the evaluation at the equal steps
        if len(evaluated.get(steps - 1, [])) == WORLD:
            outcome.perplexity = statistics.fmean(p for _, p in evaluated[steps - 1])
    elif ran.status == "ok" and len(ran.evaluations) == WORLD:
        outcome.perplexity = statistics.fmean(e["perplexity"] for e in ran.evaluations)
    return outcome


def read_command_job(outcome: Outcome, run_dir: Path) -> Outcome:
    """torchft's figures from its workers' JSON lines (examples/torchft/train_diloco.py):
    its process group counts no bytes, nor its waits."""
    lines = []
    for log in sorted((run_dir / "logs").glob("worker-*.stdout")):
        lines.append([json.loads(line) for line in log.read_text().splitlines()
                      if line.startswith("{")])
    if len(lines) != WORLD or not all(lines):
        return outcome
    ends = [worker[-1] for worker in lines]
    evaluated: dict[int, list[tuple[float, float]]] = {}
    for worker in lines:
        for line in worker:
            if "perplexity" in line and "step" in line:
                evaluated.setdefault(line["step"], []).append((line["seconds"],
                                                               line["perplexity"]))
    outcome.curve = [(max(t for t, _ in points), statistics.fmean(p for _, p in points))
                     for _, points in sorted(evaluated.items()) if len(points) == WORLD]
    if outcome.status == "ok" and all("rank" in end for end in ends):
        outcome.perplexity = statistics.fmean(end["perplexity"] for end in ends)
        outcome.training_seconds = max(end["seconds"] for end in ends)
    return outcome


def collectives_of(method: str, collectives: list[str]) -> list[str]:
    """The chosen collectives `method` runs over: torchft only its own, Moshpit only some."""
    if method == TORCHFT:
        return ["torchft"] if "torchft" in collectives else []
    return [c for c in collectives
            if c != "torchft" and (c != "moshpit" or method in MOSHPIT_METHODS)]


def plan(networks: list[str], methods: list[str], collectives: list[str],
         seeds: list[int]) -> list[Cell]:
    """Per network and seed, DDP first (the reference of the others), then the methods, each
    over the collectives it runs on."""
    ordered = sorted(methods, key=lambda method: method != "ddp")
    return [Cell(network, method, collective, seed)
            for network in networks for seed in seeds for method in ordered
            for collective in collectives_of(method, collectives)]


# -- the report ------------------------------------------------------------------------------


def reference(outcome: Outcome, outcomes: list[Outcome]) -> Outcome | None:
    """DDP of the same network and seed over the same collective (Moshpit, which has no DDP
    cell: over the ring, which counts its bytes as Moshpit does; torchft: over gloo, its own
    process group's)."""
    collective = {"moshpit": "ring", "torchft": "gloo"}.get(outcome.cell.collective,
                                                           outcome.cell.collective)
    return next((o for o in outcomes if o.cell == Cell(outcome.cell.network, "ddp", collective,
                                                       outcome.cell.seed)
                 and o.status == "ok"), None)


def time_to_reach(outcome: Outcome, target: float) -> float:
    """Seconds of training until the mean held-out perplexity first reached `target`."""
    return next((seconds for seconds, perplexity in outcome.curve if perplexity <= target),
                math.nan)


@dataclass
class Versus:
    """One cell against its DDP reference."""

    perplexity_change: float  # percent
    fewer_bytes: float  # DDP's bytes over this cell's (NaN where the collective counts none)
    time_share: float  # seconds to DDP's final perplexity over DDP's training seconds


def versus(outcome: Outcome, outcomes: list[Outcome]) -> Versus | None:
    ddp = reference(outcome, outcomes)
    if ddp is None or outcome.status != "ok":
        return None
    return Versus(100 * (outcome.perplexity / ddp.perplexity - 1),
                  ddp.bytes_sent / outcome.bytes_sent,
                  time_to_reach(outcome, ddp.perplexity) / ddp.training_seconds)


def mean_spread(values: list[float], digits: int = 3) -> str:
    """`mean ± standard deviation` over the seeds (no spread with one), '-' for none."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    spread = f" ± {fmt(statistics.stdev(values), 2)}" if len(values) > 1 else ""
    return f"{fmt(statistics.fmean(values), digits)}{spread}"


def groups(outcomes: list[Outcome]) -> dict[tuple[str, str, str], list[Outcome]]:
    """The outcomes by (network, method, collective), over the seeds, in the order run."""
    grouped: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in outcomes:
        grouped.setdefault((o.cell.network, o.cell.method, o.cell.collective), []).append(o)
    return grouped


def table(outcomes: list[Outcome], network: str) -> list[str]:
    rows = ["| method | collective | seeds ok | perplexity | vs DDP | MB sent / worker | "
            "DDP's bytes / these | time to DDP's final perplexity (share of DDP's) | "
            "training s | longest outer wait s | status |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (net, method, collective), cells in groups(outcomes).items():
        if net != network:
            continue
        done = [o for o in cells if o.status == "ok"]
        against = [v for o in done if (v := versus(o, outcomes)) is not None]
        changes = [v.perplexity_change for v in against]
        statuses = sorted({status_text(o) for o in cells if o.status != "ok"})
        rows.append(
            f"| {method} | {collective} | {len(done)}/{len(cells)} | "
            f"{mean_spread([o.perplexity for o in done], 4)} | "
            f"{mean_spread(changes, 2) + '%' if changes and method != 'ddp' else '-'} | "
            f"{mean_spread([o.bytes_sent / 1e6 for o in done])} | "
            f"{mean_spread([v.fewer_bytes for v in against]) if method != 'ddp' else '-'} | "
            f"{mean_spread([v.time_share for v in against], 2)} | "
            f"{mean_spread([o.training_seconds for o in done])} | "
            f"{mean_spread([o.outer_wait for o in done], 2)} | "
            f"{'; '.join(statuses) or 'ok'} |")
    return rows


def targets(outcomes: list[Outcome], steps: int) -> list[str]:
    """The issue's targets, each met or missed (or not measured) from this run's numbers."""
    said = []
    grouped = groups(outcomes)
    for (network, method, collective), cells in grouped.items():
        if method != "diloco-h50":
            continue
        against = [v for o in cells if (v := versus(o, outcomes)) is not None]
        if not against:
            said.append(f"- DiLoCo H=50 over {collective}, {network}: not measured (no "
                        "completed pair with DDP).")
            continue
        change = statistics.fmean(v.perplexity_change for v in against)
        fewer = statistics.fmean(v.fewer_bytes for v in against)
        if math.isnan(fewer):
            said.append(f"- DiLoCo H=50 over {collective}, {network}: perplexity "
                        f"{change:+.2f}% against DDP at equal steps ({len(against)} seeds), "
                        f"{'within' if abs(change) <= WITHIN else 'outside'} {WITHIN:g}%; "
                        f"bytes not counted ({collective}'s stats carry none): the byte "
                        "target is read on the other collectives.")
        else:
            met = abs(change) <= WITHIN and fewer >= FEWER_BYTES
            said.append(f"- DiLoCo H=50 over {collective}, {network}: perplexity "
                        f"{change:+.2f}% against DDP at equal steps with {fewer:.1f}x fewer "
                        f"bytes ({len(against)} seeds): **{'met' if met else 'missed'}** "
                        f"(target: within {WITHIN:g}% with at least {FEWER_BYTES:g}x fewer "
                        "bytes)" + ("" if met else f"; {missed_because(change, fewer)}") + ".")
        short = [o for o in cells if o.trained(steps) < o.cell.steps_run(steps)]
        if network == SLOW_NETWORK and short:
            said.append(f"- DiLoCo H=50 over {collective} on {network}: the wall-clock to DDP's "
                        f"final perplexity not measured: {len(short)} record(s) trained only "
                        f"the {steps} equal steps, from before the cell ran on to "
                        f"{REACH}x them (`--resume` runs it again).")
        elif network == SLOW_NETWORK:
            shares = [v.time_share for v in against]
            share = statistics.fmean(shares)
            reached = all(math.isfinite(s) for s in shares)
            met = reached and share <= WALL_SHARE
            said.append(f"- DiLoCo H=50 over {collective} on {network}: DDP's final "
                        f"perplexity reached in "
                        + (f"{share:.2f} of DDP's wall-clock" if reached else
                           "no run's time (some seed never reached it)")
                        + f": **{'met' if met else 'missed'}** (target: at most a third).")
    for (network, method, collective), cells in grouped.items():
        if method != "streaming":
            continue
        ok = [o for o in cells if o.status == "ok" and math.isfinite(o.outer_wait)]
        if not ok:
            continue
        waits = [o.outer_wait for o in ok]
        said.append(f"- Streaming DiLoCo (overlap) over {collective}, {network}: the "
                    f"longest wait of an inner step for an outer all-reduce "
                    f"{max(waits):.3f} s over {len(waits)} runs: "
                    f"**{'met' if max(waits) == 0 else 'missed'}** (target: never waits)"
                    + wait_causes(ok) + ".")
    return said or ["- No target could be measured in this run."]


def wait_causes(cells: list[Outcome]) -> str:
    """What a fragment's all-reduce had to fit in (its result is due H inner steps after it
    left), from the runs that recorded it: the longest outer all-reduce and the largest gap
    between the workers at one step (a call ends only once the last worker has joined it)."""
    timed = [o for o in cells if math.isfinite(o.outer_call) and math.isfinite(o.worker_lag)]
    if not timed:
        return ""
    return (f"; longest outer all-reduce {max(o.outer_call for o in timed):.2f} s, largest gap "
            f"between the workers at one step {max(o.worker_lag for o in timed):.2f} s "
            f"({len(timed)} of the runs recorded these)")


def missed_because(change: float, fewer: float) -> str:
    causes = []
    if abs(change) > WITHIN:
        causes.append(f"the perplexity is {abs(change) - WITHIN:.2f} points outside the band")
    if fewer < FEWER_BYTES:
        causes.append(f"{fewer:.1f}x fewer bytes (an outer all-reduce every 50 inner steps "
                      "sends about what DDP sends every step: about 50x at most)")
    return "; ".join(causes)


def torchft_agreement(outcomes: list[Outcome]) -> list[str]:
    """torchft's DiLoCo against the testbed's over gloo, seed by seed: the same algorithm on the
    same all-reduce should end at the same perplexity."""
    said = []
    for outcome in outcomes:
        if outcome.cell.method != TORCHFT or outcome.status != "ok":
            continue
        ours = next((o for o in outcomes if o.status == "ok" and o.cell == Cell(
            outcome.cell.network, "diloco-h50", "gloo", outcome.cell.seed)), None)
        if ours is not None:
            said.append(f"- torchft's DiLoCo against `diloco-h50` over gloo, "
                        f"{outcome.cell.network}, seed {outcome.cell.seed}: perplexity "
                        f"{outcome.perplexity:.4f} against {ours.perplexity:.4f} "
                        f"({100 * (outcome.perplexity / ours.perplexity - 1):+.3f}%).")
    return said or [f"- The outside reference (`{TORCHFT}`, torchft's DiLoCo) was not run "
                    "beside `diloco-h50` over gloo in this run."]


def provenance(records: list[Record]) -> list[str]:
    """One paragraph per process that wrote records: its command, date, machine and cells."""
    latest: dict[str, Record] = {}
    counts: dict[str, int] = {}
    for record in records:
        counts[record.started] = counts.get(record.started, 0) + 1
        if record.started not in latest or record.seconds > latest[record.started].seconds:
            latest[record.started] = record
    return [line for started in sorted(latest) for line in
            (f"{latest[started].written_by} Cells recorded: {counts[started]}.", "")]


def report(records: list[Record], steps: int, eval_every: int, note: str = "",
           networks: list[str] | None = None) -> str:
    """The results file from the records (all of `steps` and `eval_every`)."""
    outcomes = [record.outcome for record in records]
    networks = [n for n in NETWORKS if n in (networks or []) or
                any(o.cell.network == n for o in outcomes)]
    lines = [
        "# DiLoCo and Streaming DiLoCo against synchronous DDP", "",
        *([f"**{note}**", ""] if note else []), *provenance(records),
        f"How: every cell is one `ClusterRun` (backend auto) of a scenario written by the "
        f"benchmark: {WORLD} workers, each a process in its own network namespace, every link "
        "shaped alike. The job is the same in every cell but for its strategy: `char-lm` "
        f"(2-layer transformer, context 64, stdlib corpus), batch {JOB['batch']} per worker, "
        f"AdamW lr {JOB['optimizer']['adamw']['lr']:g} (DiLoCo's inner optimizer; the outer "
        f"one SGD lr 0.7, momentum 0.9, Nesterov), {steps} steps, held-out evaluation every "
        f"{eval_every} steps ({JOB['eval_samples']} windows). Methods: " + "; ".join(
            f"`{name}` {spec}" for name, spec in METHODS.items() if name != TORCHFT)
        + f"; `{TORCHFT}` torchft's DiLoCo, H = {TORCHFT_INNER_STEPS}, the same job as a "
        "command (examples/torchft/train_diloco.py, its own gloo process group)"
        + f"; `streaming` with compressor {COMPRESSOR['streaming']}.",
        "",
        "Columns, over the seeds (mean ± standard deviation): `perplexity` after the last step "
        "(mean of the four workers: equal inner steps for every method), `vs DDP` its change "
        "against DDP over the same collective, network and seed (Moshpit's cells: against "
        "the ring's DDP; torchft's: gloo's), `MB sent / worker` what each worker's "
        "collective sent in the whole run (`-` for gloo and torchft, whose process groups "
        "count no bytes), "
        "`DDP's bytes / these` how many times fewer that is, `time to DDP's final "
        "perplexity` the training wall-clock until the workers' mean held-out perplexity "
        "first reached DDP's final one, as a share of DDP's own training time (read at the "
        "evaluations: `-` where it never did), `training s` from the start of training to "
        "the last step, `longest outer wait s` the longest an inner step waited for outer "
        "all-reduces (DiLoCo; the wait for what is in flight at the last step is not an "
        f"inner step's). On {SLOW_NETWORK}, `diloco-h50` trains on to {REACH}x the steps "
        "(behind DDP at equal steps, it reaches DDP's final perplexity later, and that "
        "wall-clock is its target there); its other columns are read at the equal steps.",
        "",
    ]
    for network in networks:
        profile = NETWORKS[network]
        shaped = ", ".join(f"{k} {v}" for k, v in profile.items()) or "unshaped"
        lines += [f"## {network} ({shaped})", "", *table(outcomes, network), ""]
    lines += ["## Targets (checked from the recorded cells' numbers)", "",
              *targets(outcomes, steps), "",
              "## The outside reference", "", *torchft_agreement(outcomes), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps, the first seed, network clean only")
    parser.add_argument("--steps", type=int, help=f"steps per cell (default {STEPS})")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="comma-separated scenario seeds (default: %(default)s)")
    parser.add_argument("--networks", default=",".join(NETWORKS),
                        help="comma-separated, of %(default)s")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, of %(default)s")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="comma-separated, of %(default)s")
    parser.add_argument("--timeout", type=float, help=f"seconds per run (default {TIMEOUT:.0f})")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells already recorded beside --out and run the rest "
                        "(default: start over)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the results file; its cells are recorded in NAME-cells/ beside it")
    args = parser.parse_args()
    chosen = {}
    for name, allowed in (("networks", NETWORKS), ("methods", METHODS),
                          ("collectives", COLLECTIVES)):
        chosen[name] = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        unknown = sorted(set(chosen[name]) - set(allowed))
        if unknown or not chosen[name]:
            parser.error(f"--{name}: expected some of {', '.join(allowed)}, got "
                         f"{getattr(args, name)!r}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if args.quick:
        seeds, chosen["networks"] = seeds[:1], ["clean"]
    eval_every = QUICK_EVAL_EVERY if args.quick else EVAL_EVERY
    if args.steps is not None and (args.steps <= 0 or args.steps % eval_every):
        parser.error(f"--steps: expected a positive multiple of {eval_every} (the evaluations' "
                     f"interval: every cell is evaluated at the equal steps), got {args.steps}")
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and shaping")
    from netem.capabilities import netem_available

    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    timeout = args.timeout or (QUICK_TIMEOUT if args.quick else TIMEOUT)
    directory = records_dir(args.out)
    directory.mkdir(parents=True, exist_ok=True)
    if args.resume:
        kept = load_records(directory)
        other = sorted({(r.steps, r.eval_every) for r in kept} - {(steps, eval_every)})
        if other:
            parser.error(f"--resume: {directory} holds cells of {other[0][0]} steps evaluated "
                         f"every {other[0][1]}, this run has {steps} and {eval_every}: run with "
                         "those, or without --resume to start over")
    else:
        for path in directory.glob("*.json"):
            path.unlink()
        kept = []
    done = recorded(kept, steps)
    cells = [cell for cell in plan(chosen["networks"], chosen["methods"],
                                   chosen["collectives"], seeds) if cell not in done]
    full = len(plan(list(NETWORKS), list(METHODS), list(COLLECTIVES), list(SEEDS)))
    shapes_delay = netem_available()
    run = Run.start("benchmarks.diloco")
    print(f"{len(done)} recorded cells kept ({directory}), {len(cells)} to run",
          file=sys.stderr)

    def rewrite() -> str:
        records = load_records(directory)  # other processes' too
        note = ("Quick run: one seed, few steps, one network." if args.quick else
                "" if len(records) >= full else
                f"Partial: {len(records)} of the full benchmark's {full} cells "
                f"({', '.join(NETWORKS)}; seeds {', '.join(map(str, SEEDS))}) recorded so far.")
        text = report(records, steps, eval_every, note, chosen["networks"])
        args.out.write_text(text)
        return text

    with tempfile.TemporaryDirectory(prefix="tb-diloco-") as tmp:
        for number, cell in enumerate(cells, start=1):
            if "delay" in NETWORKS[cell.network] and not shapes_delay:
                outcome = Outcome(cell, "skipped", "this kernel has no sch_netem for the delay: "
                                  "run in the UML sandbox")
            else:  # recorded only where it ran: a skip is this kernel's, not the cell's
                outcome = run_cell(cell, steps, eval_every, timeout, Path(tmp))
                elapsed = run.elapsed()
                Record(outcome, steps, eval_every, run.started.isoformat(), elapsed,
                       machine.written_by(run.command, run.started, elapsed)).save(directory)
            print(f"{run.progress(number, len(cells))} {cell.name}: {status_text(outcome)}, "
                  f"perplexity {fmt(outcome.perplexity, 4)}, "
                  f"{fmt(outcome.bytes_sent / 1e6)} MB sent per worker",
                  file=sys.stderr, flush=True)
            rewrite()
    print(rewrite())
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
