"""Training benchmark: the char-level LM on four workers under random packet loss, and
DropCompute under lognormal stragglers.

Part 1: the same job (char-lm, data, Adam, steps) at 0, 10, 20 and 30% random loss on every
link, over `lossy` (strategy sharded: the shard owners apply the optimizer; once per seed, as
one run's change is noisy; `lossy+OPTION=VALUE+...` runs it with those collective options, so
candidates sit side by side) and over `gloo` (strategy gradient) with TCP bbr and, last, TCP
cubic. The figure: the final held-out perplexity's change against the same collective's
lossless run and against gloo's lossless run with the same seed (exact, deterministic: the
cleaner reference), and wall and step time.
Part 2: the same model, no loss, gloo, every worker with a lognormal straggler delay and four
micro-batches, synchronous against DropCompute (threshold auto, 10% target drop rate): mean
step time, drop rate, final loss. Every cell is a `ClusterRun` of a scenario written here (four
namespaces; loss by the host's fallback shaping, nftables random drop), with a timeout.
Writes benchmarks/results/training.md after every cell.

    .venv/bin/python -m benchmarks.training [--quick] [--steps N] [--kinds K,..]
        [--losses 0,10,..] [--seeds 11,12,..] [--timeout S] [--drift-every N]
        [--drift-plot PNG] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.report import Run, partial
from benchmarks.scenario_runs import fmt, run_scenario, status_text
from testbed.collectives.registry import LossyOptions

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "training.md"
WORLD = 4
SEEDS = (11, 12, 13, 14, 15, 16)  # lossy's cells and EXACT's lossless one run once per seed;
# the others with the first
STEPS = 150
QUICK_STEPS = 12
LOSSES = (0.0, 0.10, 0.20, 0.30)
# Part-1 collectives ("lossy-gradient": lossy under strategy gradient, as gloo runs;
# "lossy-resync": sharded with the broadcast over TCP every step, so no copy is ever stale and
# only the gather loses contributions) and part 2
# A lossy kind may carry options of the collective: lossy+parity=4+missed=last_update.
KINDS = ("lossy", "lossy-gradient", "lossy-resync", "gloo-bbr", "gloo-cubic", "dropcompute")
DEFAULT_KINDS = ("lossy", "gloo-bbr", "dropcompute", "gloo-cubic")
JOB = {"model": "char-lm", "batch": 32, "optimizer": {"adam": {"lr": 3.0e-3}},
       "eval_samples": 1024}
STRAGGLER_MEDIAN = "20ms"  # of the lognormal straggler delay per step (sigma 1.0)
MICRO_BATCHES = 4
DROP_COMPUTE = {"threshold": "auto", "target_drop_rate": "10%"}
TIMEOUT = 360.0  # seconds for one run, start-up included
QUICK_TIMEOUT = 120.0
COLLECTIVE = {"lossy": "lossy (sharded)", "lossy-gradient": "lossy (gradient)",
              "lossy-resync": "lossy (sharded, resync every step)"}


def split_kind(kind: str) -> tuple[str, dict[str, Any]]:
    """`lossy+parity=4+settle=auto` -> ("lossy", {"parity": 4, "settle": "auto"}), the
    options checked against the collective's (a bad one is named before anything runs)."""
    base, *given = kind.split("+")
    options: dict[str, Any] = {}
    for item in given:
        name, _, text = item.partition("=")
        options[name] = yaml.safe_load(text)
    if options:
        if not base.startswith("lossy"):
            raise ValueError(f"{kind}: only lossy kinds take options")
        LossyOptions(**options)
    return base, options


def label(kind: str) -> str:
    base, options = split_kind(kind)
    name = COLLECTIVE.get(base, "gloo")
    if options:
        name = name[:-1] + ", " + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
    return name
AIM = 0.8  # percent: the paper's perplexity change at 10% loss (LLaMA2-7B)
# Exact data-parallel training, and deterministic: its lossless run with a seed is the reference
# for lossy's runs with that seed (lossy's own lossless result varies with arrival order).
EXACT = "gloo-bbr"


@dataclass(frozen=True)
class Cell:
    """One run: a collective at a loss (part 1), or a DropCompute mode (part 2)."""

    kind: str  # one of KINDS but dropcompute, or sync | dropcompute
    loss: float = 0.0
    median: str = STRAGGLER_MEDIAN  # part 2's straggler
    seed: int = SEEDS[0]

    @property
    def name(self) -> str:
        if self.kind in ("sync", "dropcompute"):
            return self.kind
        kind = re.sub(r"[^A-Za-z0-9._-]", "-", self.kind)  # a scenario name's characters
        return f"{kind}-loss{round(self.loss * 100)}-seed{self.seed}"

    def scenario(self, steps: int, drift_every: int = 0) -> dict[str, Any]:
        """The scenario, as the YAML the runner loads."""
        job: dict[str, Any] = {**JOB, "steps": steps}
        topology: dict[str, Any] = {"congestion": "bbr"}
        collective: dict[str, Any] = {"kind": "gloo"}
        base, options = split_kind(self.kind)
        if base.startswith("lossy"):
            job["strategy"] = "gradient" if base == "lossy-gradient" else "sharded"
            collective = {"kind": "lossy", **options}
            if base == "lossy-resync":
                collective["resync_every"] = 1
        elif self.kind.startswith("gloo"):
            topology["congestion"] = self.kind.split("-")[1]
        else:
            job.update(micro_batches=MICRO_BATCHES,
                       straggler={"lognormal": {"median": self.median, "sigma": 1.0}})
            if self.kind == "dropcompute":
                job["drop_compute"] = DROP_COMPUTE
        if self.loss:
            topology["default"] = {"loss": f"{round(self.loss * 100)}%"}
        return {"name": f"training-{self.name}", "seed": self.seed, "workers": WORLD,
                "topology": topology, "job": job, "collective": collective,
                "metrics": {"drift_every": drift_every}}


@dataclass
class Outcome:
    cell: Cell
    status: str  # ok | timeout | failed | skipped
    steps: int = 0
    perplexity: float = math.nan  # held-out, mean over workers
    perplexity_spread: float = 0.0  # max - min over workers
    eval_loss: float = math.nan
    train_loss: float = math.nan  # last step's, mean over workers
    step_seconds: float = math.nan
    compute_seconds: float = math.nan
    wait_seconds: float = math.nan
    wall: float = math.nan  # the run's, start-up included
    coverage: float = math.nan
    late: float = math.nan  # lossy: datagrams that came after their phase ended, all workers
    drop_rate: float = math.nan
    threshold: float = math.nan
    bytes_per_step: float = math.nan  # sent per worker and step, headers included
    drift: list[tuple[int, float]] = field(default_factory=list)  # (step, mean over workers)
    congestion: str = ""
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def run_cell(cell: Cell, steps: int, timeout: float, workdir: Path,
             drift_every: int = 0) -> Outcome:
    """Run the cell's scenario within `timeout`, read its figures from the run."""
    import numpy as np

    ran = run_scenario(cell.scenario(steps, drift_every), cell.name, workdir, timeout)
    outcome = Outcome(cell, ran.status, wall=ran.wall, note=ran.note)
    run = ran.run
    if run is None:
        return outcome
    summary = run.summary or {}
    outcome.steps = int(summary.get("steps") or 0)
    outcome.congestion = "/".join(sorted({str(v) for e in run.other if e.get("type") == "cluster"
                                          for v in (e.get("congestion") or {}).values()}))
    if run.steps:
        outcome.train_loss = summary.get("final_loss") or math.nan
        outcome.step_seconds = float(np.nanmean(run.column("step_seconds")))
        outcome.compute_seconds = float(np.nanmean(run.column("compute_seconds")))
        outcome.wait_seconds = float(np.nanmean(run.column("wait_seconds")))
        outcome.coverage = float(np.nanmean(run.column("coverage")))
        outcome.late = float(np.nansum(run.column("datagrams_late")))
        outcome.bytes_per_step = float(np.nanmean(run.column("bytes_sent")))
        drifts: dict[int, list[float]] = {}
        for step in run.steps:
            if step.drift is not None:
                drifts.setdefault(step.step, []).append(step.drift)
        outcome.drift = [(s, sum(d) / len(d)) for s, d in sorted(drifts.items())]
        outcome.drop_rate = summary.get("drop_rate") or 0.0
        thresholds = run.column("threshold_seconds")
        thresholds = thresholds[np.isfinite(thresholds)]
        outcome.threshold = float(thresholds[-1]) if thresholds.size else math.nan
    if ran.status == "ok" and len(ran.evaluations) == WORLD:
        perplexities = [e["perplexity"] for e in ran.evaluations]
        outcome.perplexity = sum(perplexities) / WORLD
        outcome.perplexity_spread = max(perplexities) - min(perplexities)
        outcome.eval_loss = sum(e["loss"] for e in ran.evaluations) / WORLD
    return outcome


# -- the report ------------------------------------------------------------------------------


def fixed(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3f}"


def percent(change: float) -> str:
    return "-" if not math.isfinite(change) else f"{round(change, 2) + 0.0:+.2f}%"


def baseline(outcomes: list[Outcome], kind: str, seed: int) -> Outcome | None:
    return next((o for o in outcomes if o.cell.kind == kind and o.cell.seed == seed
                 and o.cell.loss == 0 and o.status == "ok"), None)


def change(o: Outcome, outcomes: list[Outcome], against: str | None = None) -> float:
    """Percent change of the held-out perplexity against the 0% run with the same seed of
    collective `against` (default: the same collective)."""
    clean = baseline(outcomes, against or o.cell.kind, o.cell.seed)
    if clean is None or not math.isfinite(o.perplexity):
        return math.nan
    return 100 * (o.perplexity / clean.perplexity - 1)


def loss_table(outcomes: list[Outcome]) -> list[str]:
    rows = [
        "| collective | transport | seed | loss | steps | perplexity | change vs 0% | "
        "vs exact 0% | held-out loss | mean step s | compute s | wait s | wall s | coverage | "
        "late | kB sent/step | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        if o.cell.kind in ("sync", "dropcompute"):
            continue
        spread = (f" (±{o.perplexity_spread / 2:.3f})" if o.perplexity_spread > 5e-4 else "")
        delta, exact = change(o, outcomes), change(o, outcomes, EXACT)
        transport = "UDP" if o.cell.kind.startswith("lossy") else f"TCP {o.congestion or '?'}"
        rows.append(
            f"| {label(o.cell.kind)} | {transport} | {o.cell.seed} | "
            f"{o.cell.loss:.0%} | "
            f"{o.steps} | {fixed(o.perplexity)}{spread} | "
            f"{percent(delta)} | {percent(exact)} | {fixed(o.eval_loss)} | "
            f"{fmt(o.step_seconds)} | {fmt(o.compute_seconds)} | {fmt(o.wait_seconds)} | "
            f"{fmt(o.wall)} | {fmt(o.coverage)} | "
            f"{fmt(o.late) if o.cell.kind.startswith('lossy') else '-'} | "
            f"{fmt(o.bytes_per_step / 1e3)} | {status_text(o)} |")
    return rows


def drop_table(outcomes: list[Outcome]) -> list[str]:
    rows = [
        "| mode | steps | mean step s | compute s | wait s | drop rate | threshold s | "
        "final train loss | held-out loss | perplexity | wall s | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        if o.cell.kind not in ("sync", "dropcompute"):
            continue
        rows.append(
            f"| {o.cell.kind} | {o.steps} | {fmt(o.step_seconds)} | {fmt(o.compute_seconds)} | "
            f"{fmt(o.wait_seconds)} | {fmt(o.drop_rate)} | {fmt(o.threshold)} | "
            f"{fixed(o.train_loss)} | {fixed(o.eval_loss)} | {fixed(o.perplexity)} | "
            f"{fmt(o.wall)} | {status_text(o)} |")
    return rows


def standard_error(values: list[float]) -> str:
    if len(values) < 2:
        return ""
    return f" ± {statistics.stdev(values) / math.sqrt(len(values)):.2f}"


def part1_kinds(outcomes: list[Outcome]) -> list[str]:
    """The part-1 kinds of this run, in the order they ran (lossy variants included)."""
    return list(dict.fromkeys(o.cell.kind for o in outcomes
                              if o.cell.kind not in ("sync", "dropcompute")))


def seed_means(outcomes: list[Outcome], kind: str, against: str | None
               ) -> dict[float, list[float]]:
    """Per loss above 0, the perplexity changes of `kind`'s seeds (against the same seed's
    lossless run of `against`, default the kind's own)."""
    changes: dict[float, list[float]] = {}
    for o in outcomes:
        delta = change(o, outcomes, against)
        if o.cell.kind == kind and o.cell.loss > 0 and math.isfinite(delta):
            changes.setdefault(o.cell.loss, []).append(delta)
    return dict(sorted(changes.items()))


def candidates_table(outcomes: list[Outcome]) -> list[str]:
    """Per lossy kind and loss, over its seeds: the perplexity change against the exact
    lossless run (mean ± standard error), the step against the kind's own lossless step of the
    same seed, and the bytes each worker sent per step."""
    rows = ["| collective | loss | seeds | vs exact 0% (mean ± se) | range | step vs own 0% | "
            "kB sent/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in part1_kinds(outcomes):
        if not kind.startswith("lossy"):
            continue
        changes = seed_means(outcomes, kind, EXACT)
        for loss in sorted({o.cell.loss for o in outcomes if o.cell.kind == kind}):
            done = [o for o in outcomes if o.cell.kind == kind and o.cell.loss == loss
                    and o.status == "ok"]
            ratios = [o.step_seconds / clean.step_seconds for o in done
                      if (clean := baseline(outcomes, kind, o.cell.seed)) is not None]
            delta = changes.get(loss, [])
            perplexity = (f"{statistics.fmean(delta):+.2f}%{standard_error(delta)} | "
                          f"{min(delta):+.2f}% to {max(delta):+.2f}%" if delta else "- | -")
            step = f"{statistics.fmean(ratios):.2f}x" if ratios else "-"
            sent = (fmt(statistics.fmean(o.bytes_per_step for o in done) / 1e3) if done
                    else "-")
            rows.append(f"| {label(kind)} | {loss:.0%} | {len(done)} | {perplexity} | {step} | "
                        f"{sent} |")
    return rows


def observations(outcomes: list[Outcome]) -> list[str]:
    """Sentences drawn from this run's numbers only."""
    said: list[str] = []
    for kind in part1_kinds(outcomes):
        for seed in sorted({o.cell.seed for o in outcomes if o.cell.kind == kind}):
            clean = baseline(outcomes, kind, seed)
            lossy = [o for o in outcomes
                     if o.cell.kind == kind and o.cell.seed == seed and o.cell.loss > 0]
            if clean is None or not lossy:
                continue
            parts = []
            for o in lossy:
                if o.status == "ok":
                    parts.append(f"{change(o, outcomes):+.2f}% perplexity, step "
                                 f"{o.step_seconds / clean.step_seconds:.2f}x at "
                                 f"{o.cell.loss:.0%}")
                else:
                    parts.append(f"{status_text(o)} at {o.cell.loss:.0%}")
            said.append(f"{kind}, seed {seed} (0%: perplexity {clean.perplexity:.3f}, step "
                        f"{clean.step_seconds:.3f} s): " + "; ".join(parts) + ".")
    lossy_kinds = [kind for kind in part1_kinds(outcomes) if kind.startswith("lossy")]
    for kind, (against, words) in itertools.product(lossy_kinds, (
            (None, "against its own lossless run"),
            (EXACT, f"against {EXACT}'s exact lossless run"))):
        changes = seed_means(outcomes, kind, against)
        if not changes:
            continue
        means = {loss: statistics.fmean(d) for loss, d in sorted(changes.items())}
        said.append(f"{kind}'s perplexity change {words} of the same seed, mean over seeds "
                    "(± standard error where several): " + ", ".join(
                        f"{mean:+.2f}%{standard_error(changes[loss])} at {loss:.0%} "
                        f"({len(changes[loss])} seeds, {min(changes[loss]):+.2f}% to "
                        f"{max(changes[loss]):+.2f}%)" for loss, mean in means.items()) + ".")
        if 0.1 in means:
            said.append(f"At 10% loss that mean is "
                        f"{'within' if abs(means[0.1]) <= AIM else 'outside'} the paper's "
                        f"{AIM}%.")
    sync = next((o for o in outcomes if o.cell.kind == "sync" and o.status == "ok"), None)
    drop = next((o for o in outcomes if o.cell.kind == "dropcompute" and o.status == "ok"), None)
    if sync and drop:
        said.append(f"DropCompute: step {drop.step_seconds:.3f} s against {sync.step_seconds:.3f}"
                    f" s synchronous ({sync.step_seconds / drop.step_seconds:.2f}x), "
                    f"{drop.drop_rate:.1%} of micro-batches dropped, held-out loss "
                    f"{drop.eval_loss:.4f} against {sync.eval_loss:.4f}.")
    return said


def report(outcomes: list[Outcome], run: Run, steps: int, median: str, seeds: list[int],
           note: str = "") -> str:
    return "\n".join([
        *run.header("Training under packet loss: lossy against gloo; DropCompute against "
                    "synchronous", note),
        f"How: every cell is one `ClusterRun` (backend auto) of a scenario written by the "
        f"benchmark: {WORLD} workers, each a process in its own network namespace, links "
        "unshaped but for the loss (the host's fallback shaping: nftables random drop on "
        "every receiver, this kernel has no sch_netem). The job is the same in every cell of "
        f"part 1: `char-lm` (2-layer transformer, context 64, stdlib corpus), "
        f"seed {', '.join(str(seed) for seed in seeds)} for lossy's cells and {EXACT}'s "
        "lossless one (a seed sets the model's initial weights and the data order; each "
        "seed's lossy runs compare with its own lossless run and with the exact one), "
        f"{seeds[0]} for gloo's lossy cells and part 2's (gloo is exact: its result does not "
        f"depend on the loss), batch {JOB['batch']} per worker, "
        f"Adam lr {JOB['optimizer']['adam']['lr']:g}, "
        f"{steps} steps; `lossy` runs strategy `sharded` (the shard owners apply Adam to "
        "their shard and broadcast parameters, both phases as datagrams) with its default "
        "options (`lossy (gradient)`, where run: an all-reduce of the gradients as datagrams, "
        "a missing chunk filled with the worker's own, every worker applying Adam; `lossy "
        "(sharded, resync every step)`, where run: the broadcast over TCP every step, so no "
        "copy is stale and only the gather loses contributions; `lossy (sharded, "
        "OPTION=VALUE, ...)`: the same with those options of the collective, the candidates "
        "against what loss costs, docs/collectives.md); `gloo` "
        "runs strategy `gradient` (all-reduce of the gradients over TCP) with "
        "the namespaces' TCP congestion control set to the one in the transport column (as "
        "the run's cluster event recorded it). Each run "
        "has a timeout (start-up included); a collective that timed out at one loss is not "
        "tried at a higher one.",
        "",
        "Columns: `perplexity` is exp of the held-out cross-entropy per character after the "
        f"last step ({JOB['eval_samples']} held-out windows of 64 characters), the mean over "
        "the four workers (± half their spread where the copies differ: lossy workers can "
        "hold stale parameters where a broadcast was lost); `change vs 0%` is its change "
        "against the same collective's lossless run with the same seed, `vs exact 0%` "
        f"against {EXACT}'s (exact data-parallel training, deterministic; lossy's own "
        "lossless result varies from run to run as its owners sum in arrival order); "
        "`mean step s` is the workers' mean step "
        "time, split into `compute s` (forward, backward, injected delay) and `wait s` (the "
        "collective and the update); `wall s` is the whole run, its start-up "
        "(namespaces, four torch imports, corpus) included; `coverage` is lossy's mean "
        "fraction of contributions in the result, `late` its datagrams that came after their "
        "phase had ended (summed over the workers and steps): the host's doing, not the link's.",
        "",
        "## Part 1: random loss on every link",
        "",
        *loss_table(outcomes),
        "",
        "Per lossy collective and loss, over the seeds: the perplexity change against "
        f"{EXACT}'s exact lossless run of the same seed, the mean step against the same "
        "collective's lossless step of the same seed, and what each worker sent per step "
        "(datagram headers included).",
        "",
        *candidates_table(outcomes),
        "",
        "## Part 2: DropCompute under lognormal stragglers",
        "",
        f"The same model, no loss, gloo (bbr), {MICRO_BATCHES} micro-batches of "
        f"{JOB['batch'] // MICRO_BATCHES} per step, every worker delayed each step by a "
        f"lognormal draw (median {median}, sigma 1.0, spread over its micro-batches). "
        "`sync`: every worker computes all micro-batches; `dropcompute`: threshold auto, "
        "calibrated after 10 full warm-up steps so that 10% of the micro-batches would be "
        "dropped. `threshold s` is the calibrated compute-time threshold; `final train loss` "
        "the last step's training loss (mean over workers), `held-out loss` and `perplexity` "
        "as above.",
        "",
        *drop_table(outcomes),
        "",
        "## Observations (generated from this run's numbers)",
        "",
        " ".join(observations(outcomes)),
        "",
    ])


def plan(kinds: list[str], losses: list[float], median: str,
         seeds: Sequence[int] = SEEDS, reference_only: bool = False) -> list[Cell]:
    """The cells in the order of `kinds`, each part-1 collective at every loss: lossy's once
    per seed (a seed's lossless run next to its lossy ones), EXACT's lossless run once per
    seed (the exact reference), the rest of gloo's and part 2's with the first seed (gloo is
    exact: its result does not depend on the loss). `reference_only`: EXACT only for its
    lossless runs."""
    cells: list[Cell] = []
    for kind in kinds:
        if kind == "dropcompute":
            cells += [Cell("sync", median=median, seed=seeds[0]),
                      Cell("dropcompute", median=median, seed=seeds[0])]
        elif kind.startswith("lossy"):
            cells += [Cell(kind, loss, seed=seed) for seed in seeds for loss in losses]
        else:
            cells += [Cell(kind, loss, seed=seed) for loss in losses
                      if not (reference_only and kind == EXACT and loss)
                      for seed in (seeds if kind == EXACT and loss == 0 else seeds[:1])]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps per cell, {QUICK_TIMEOUT:.0f} s timeout")
    parser.add_argument("--steps", type=int, help=f"steps per cell (default {STEPS})")
    parser.add_argument("--timeout", type=float, help=f"seconds per run (default {TIMEOUT:.0f})")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated, run in this order, of {', '.join(KINDS)} "
                        f"(default: {','.join(DEFAULT_KINDS)})")
    parser.add_argument("--losses", default=",".join(f"{round(x * 100)}" for x in LOSSES),
                        help="comma-separated loss percentages for part 1 (default: %(default)s)")
    parser.add_argument("--straggler-median", default=STRAGGLER_MEDIAN,
                        help="median of part 2's lognormal straggler delay (default: %(default)s)")
    parser.add_argument("--seeds", default=",".join(str(seed) for seed in SEEDS),
                        help="comma-separated scenario seeds (model, data order, stragglers): "
                        f"lossy's cells and {EXACT}'s lossless one run once per seed, the "
                        "others with the first "
                        "(default: %(default)s)")
    parser.add_argument("--reference-only", action="store_true",
                        help=f"run {EXACT} only for its lossless reference runs")
    parser.add_argument("--drift-every", type=int, default=0,
                        help="measure parameter drift every N steps (0: never)")
    parser.add_argument("--drift-plot", type=Path,
                        help="plot each lossy cell's drift over the steps here (PNG)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    try:
        unknown = sorted({kind for kind in kinds if split_kind(kind)[0] not in KINDS})
    except ValueError as error:
        parser.error(f"--kinds: {error}")
    losses = [float(x) / 100 for x in args.losses.split(",") if x.strip()]
    if unknown or not kinds:
        parser.error(f"--kinds: expected some of {', '.join(KINDS)} (lossy kinds with "
                     f"+OPTION=VALUE), got {args.kinds!r}")
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and shaping")
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    timeout = args.timeout or (QUICK_TIMEOUT if args.quick else TIMEOUT)
    run = Run.start("benchmarks.training")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    cells = plan(kinds, losses, args.straggler_median, seeds, args.reference_only)
    outcomes: list[Outcome] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tb-training-") as tmp:
        for number, cell in enumerate(cells, start=1):
            given_up = next((o for o in outcomes if o.cell.kind == cell.kind
                             and o.status == "timeout" and o.cell.loss < cell.loss), None)
            if given_up is not None:
                outcome = Outcome(cell, "skipped",
                                  note=f"timed out at {given_up.cell.loss:.0%}")
            else:
                outcome = run_cell(cell, steps, timeout, Path(tmp), args.drift_every)
            outcomes.append(outcome)
            print(f"{run.progress(number, len(cells))} "
                  f"{cell.name}: {status_text(outcome)}, perplexity {fmt(outcome.perplexity, 4)}"
                  f", step {fmt(outcome.step_seconds)} s, wall {outcome.wall:.0f} s",
                  file=sys.stderr, flush=True)
            args.out.write_text(report(outcomes, run, steps, args.straggler_median, seeds,
                                       note=partial(number, len(cells))))
    text = report(outcomes, run, steps, args.straggler_median, seeds)
    print(text)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.drift_plot is not None:
        plot_drift(outcomes, args.drift_plot)
        print(f"wrote {args.drift_plot}", file=sys.stderr)


def plot_drift(outcomes: list[Outcome], path: Path) -> None:
    """Each lossy cell's drift (mean over the workers) against the step, one line per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    for o in outcomes:
        if o.drift and o.cell.kind.startswith("lossy") and o.cell.loss > 0:
            steps, values = zip(*o.drift, strict=True)
            axes.plot(steps, values, linewidth=0.8,
                      label=f"{label(o.cell.kind)}, {o.cell.loss:.0%} loss, seed {o.cell.seed}")
    axes.set_xlabel("step")
    axes.set_ylabel("drift: ||theta_r - mean|| / ||mean||, mean over workers")
    axes.set_yscale("log")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
