"""Compression at scale: ARC-Top-K where the paper's claim applies.

ARC-Top-K's paper (Chen et al., arXiv:2510.26709) claims Top-K's accuracy and up to 60.7% less
wall-clock time for models of 60M to 1B parameters at density 0.2, where an all-reduce is
bandwidth-bound; `benchmarks.compression`'s models (9,930 and 116,447 parameters) are
latency-bound. Here: a character-level transformer of 1.28M parameters (width 160, 4 layers),
whose dense all-reduce among four workers on 100 Mbit/s takes longer than a step's compute, at
the paper's densities.

Part A: the all-reduce alone, the model's parameter vector with its shapes, among four
namespaces on 100 Mbit/s links: each compressor's call time and bytes.

Part B: training in namespaces (one `ClusterRun` per cell, four workers, 100 Mbit/s, the ring):
the wall-clock per step of each compressor, side by side, with its all-reduce and compute.

Part C: the final held-out perplexity over several seeds, the same job with four workers as
threads of one process with exact means (only the compressors differ; an exact ring computes
the same means), every compressor, both error feedbacks, and two diagnostics that pick
patterns no sketch can see (the aggregate's own top rows and top coordinates) to measure what
the construction costs and where.

Writes benchmarks/results/compression-scale.md.

    .venv/bin/python -m benchmarks.compression_scale [--steps N] [--seeds N] [--densities D,D]
        [--time-steps N] [--no-allreduce] [--no-cluster] [--no-accuracy] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compression import (
    JOBS,
    RATE,
    SEED,
    WORLD,
    gain,
    oracles,
    spread,
    train_in_process,
)
from benchmarks.report import Run
from benchmarks.scenario_runs import fmt, run_scenario

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compression-scale.md"
MODEL = "char-lm-1m"
# The paper's densities: 0.2 in every command line of its README and in its Table V; 0.08 the
# hooks' default and the other ratio its GLUE runs are named by (comm_hooks/utils.py).
DENSITIES = (0.2, 0.08)
STEPS = 120
SEEDS = 3
TIME_STEPS = 30  # part B: enough steps for a steady step time
SKIP = 3  # part B: steps left out of the step time (start-up, caches)
CALLS = 5  # part A: calls per compressor
TIMEOUT = 600.0
THREADS = 2  # part C: torch's threads (the machine's cores)


@dataclass(frozen=True)
class Variant:
    """One row: `spec` is the scenario's `collective.compressor`; `oracle` names a diagnostic
    of `benchmarks.compression.oracles` (part C only: a dense all-reduce picks its pattern)."""

    name: str
    density: float | None
    spec: dict[str, Any]
    oracle: str | None = None
    shaped: bool = True  # False: no parameter shapes, rows are blocks of `block` values

    @property
    def timed(self) -> bool:
        """Whether parts A and B time it: every compressor once (EF14 and EF21M send the
        same bytes; EF21M's first step, sent whole, is one step of many), no diagnostic."""
        return self.oracle is None and self.shaped and (self.density is None
                                                        or self.spec.get("feedback") == "ef14")


def variants(densities: list[float]) -> list[Variant]:
    """Dense, PowerSGD, and per density Top-K, Rand-K and ARC-Top-K (the paper's projection
    sketch and the marginal one) with EF14, the error feedback of the paper's released runs;
    at the first density also EF21M (the paper's theory and this project's default), the
    projection over rows of 16 consecutive values (finer than a weight's rows, one projection
    a row: a sketch of n / 16 values) and the diagnostics."""
    rows = [Variant("none", None, {"kind": "none"}),
            Variant("powersgd", None, {"kind": "powersgd", "rank": 4})]
    for i, d in enumerate(densities):
        ef14 = {"density": d, "feedback": "ef14"}
        rows += [Variant("topk, ef14", d, {"kind": "topk", **ef14}),  # ARC-Top-K right after
                 Variant("arc_topk, ef14", d, {"kind": "arc_topk", **ef14}),
                 Variant("arc_topk marginal, ef14", d,
                         {"kind": "arc_topk", "sketch": "marginal", **ef14}),
                 Variant("randk, ef14", d, {"kind": "randk", **ef14})]
        if i == 0:
            rows += [Variant("topk, ef21m", d, {"kind": "topk", "density": d}),
                     Variant("arc_topk, ef21m", d, {"kind": "arc_topk", "density": d}),
                     Variant("arc_topk rows of 16, ef14", d,
                             {"kind": "arc_topk", "block": 16, "sketch_rank": 1, **ef14},
                             shaped=False),
                     Variant("exact rows, ef14 (diagnostic)", d,
                             {"kind": "arc_topk", **ef14}, oracle="rows"),
                     Variant("mean per coordinate, ef14 (diagnostic)", d,
                             {"kind": "arc_topk", "sketch": "marginal", **ef14},
                             oracle="mean")]
    return rows


class Dense:
    """No compression, through the same in-process exchange (part C's `none`)."""

    kind = "none"

    def set_shapes(self, shapes: Any) -> None:
        """Dense: the shapes do not matter."""

    def reduce(self, call: Any, body: Any, tail: Any, step: int) -> tuple[Any, Any, dict]:
        return call.allreduce(body), tail, {"payload_bytes": 4.0 * body.numel()}


def make(variant: Variant) -> Any:
    """A fresh compressor of `variant` for one worker."""
    from testbed.collectives.compression import make_compressor

    kind = variant.spec["kind"]
    parameters = {k: v for k, v in variant.spec.items() if k != "kind"}
    if kind == "none":
        return Dense()
    if variant.oracle:
        return oracles()[variant.oracle](**parameters)
    return make_compressor(kind, 0, **parameters)


def model_shapes() -> list[tuple[int, ...]]:
    """The large model's parameter shapes, in order."""
    from testbed.train.config import TrainConfig
    from testbed.train.job import load_dataset
    from testbed.train.models import build_model

    spec = {k: v for k, v in JOBS[MODEL].items() if k != "optimizer"}
    config = TrainConfig.parse(spec, seed=SEED)
    model = build_model(config.model, load_dataset(config), config.context, SEED,
                        config.width, config.layers)
    return [tuple(p.shape) for p in model.parameters()]


# -- part A: the all-reduce alone ------------------------------------------------------------


@dataclass
class CallOutcome:
    variant: Variant
    seconds: float  # median over the calls of the slowest worker's call time
    sent: float  # bytes rank 0's collective sent in one call
    inner_calls: int


def allreduce_part(rows: list[Variant]) -> list[CallOutcome]:
    """Each timed variant over the ring among four namespaces whose links into every host are
    limited to RATE, given the model's shapes: CALLS all-reduces of a vector of the model's
    size (a shared vector plus per-worker noise), every worker a thread in its namespace."""
    import statistics

    import torch

    from netem import LinkProfile
    from netem.lab import Lab
    from testbed.collectives.compression import wrap
    from testbed.collectives.lab import close_all, on_hosts, rings, shape_every_link

    shapes = model_shapes()
    numel = sum(math.prod(shape) for shape in shapes)
    generator = torch.Generator().manual_seed(SEED)
    shared = torch.randn(numel, generator=generator)
    inputs = [shared + 0.5 * torch.randn(numel, generator=generator) for _ in range(WORLD)]
    outcomes = []
    lab = Lab(WORLD)
    lab.start()
    try:
        shape_every_link(lab, LinkProfile.parse(rate=RATE), backend="fallback")
        for i, variant in enumerate(v for v in rows if v.timed):
            workers = rings(lab, port=29700 + i, timeout=120)
            parameters = {k: v for k, v in variant.spec.items() if k != "kind"}
            group = [wrap(w, variant.spec["kind"], **parameters) for w in workers]
            try:
                for worker in group:
                    worker.set_shapes(shapes)
                times = []
                for call in range(CALLS):
                    results = on_hosts(lab, [
                        lambda r=r, c=call, g=group: g[r].allreduce(inputs[r], c)
                        for r in range(WORLD)], wait=300)
                    times.append(max(stats.seconds for _, stats in results))
                stats = results[0][1]
                outcomes.append(CallOutcome(variant, statistics.median(times),
                                            float(stats.bytes_sent),
                                            int(stats.extra.get("inner_calls", 1))))
                print(f"all-reduce {variant.name:26} {fmt(variant.density)} "
                      f"{statistics.median(times) * 1000:8.1f} ms "
                      f"{stats.bytes_sent / 1024:9.1f} KiB", flush=True)
            finally:
                close_all(lab, group)
    finally:
        lab.close()
    return outcomes


# -- part B: training steps in namespaces -----------------------------------------------------


@dataclass
class StepOutcome:
    variant: Variant
    status: str
    note: str = ""
    step_seconds: float = math.nan  # mean over workers and the steps from SKIP on
    allreduce_seconds: float = math.nan
    compute_seconds: float = math.nan
    sent_per_step: float = math.nan  # bytes one worker's collective sent per step
    ratio: float = math.nan  # payload over fp32


def scenario(variant: Variant, steps: int) -> dict[str, Any]:
    tag = variant.name.split(",")[0].replace(" ", "-")
    return {"name": f"compression-scale-{tag}-{variant.density}", "seed": SEED,
            "workers": WORLD, "topology": {"default": {"rate": RATE}, "congestion": "bbr"},
            "job": {**JOBS[MODEL], "steps": steps},
            "collective": {"kind": "ring", "compressor": variant.spec},
            "metrics": {"drift_every": 0}}


def cluster_part(rows: list[Variant], steps: int) -> list[StepOutcome]:
    """One `ClusterRun` of `steps` steps per timed variant; its step figures from SKIP on."""
    import numpy as np

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="compression-scale-") as tmp:
        for i, variant in enumerate(v for v in rows if v.timed):
            ran = run_scenario(scenario(variant, steps), f"cell-{i}", Path(tmp), TIMEOUT)
            outcome = StepOutcome(variant, ran.status, ran.note)
            run = ran.run
            if run is not None and run.steps:
                later = run.column("step") >= SKIP
                outcome.step_seconds = float(np.nanmean(run.column("step_seconds")[later]))
                outcome.allreduce_seconds = float(
                    np.nanmean(run.column("allreduce_seconds")[later]))
                outcome.compute_seconds = float(np.nanmean(run.column("compute_seconds")[later]))
                outcome.sent_per_step = float(np.nanmean(run.column("bytes_sent")[later]))
                if variant.spec["kind"] != "none":
                    outcome.ratio = float(np.nanmean(run.column("compression_ratio")[later]))
            outcomes.append(outcome)
            print(f"cluster {variant.name:26} {fmt(variant.density)} {outcome.status} step "
                  f"{fmt(outcome.step_seconds * 1000)} ms all-reduce "
                  f"{fmt(outcome.allreduce_seconds * 1000)} ms compute "
                  f"{fmt(outcome.compute_seconds * 1000)} ms {outcome.note}", flush=True)
    return outcomes


# -- part C: the final metric over seeds ---------------------------------------------------


@dataclass
class MetricOutcome:
    variant: Variant
    perplexities: list[float]  # one per seed
    values: float  # per call and worker after the first: 4-byte words the sparsifier sends
    numel: int


def accuracy_part(rows: list[Variant], steps: int, seeds: int) -> list[MetricOutcome]:
    outcomes = []
    for variant in rows:
        runs = [train_in_process(MODEL, lambda v=variant: make(v), steps, SEED + i,
                                 variant.shaped, threads=THREADS) for i in range(seeds)]
        outcomes.append(MetricOutcome(variant, [r[0] for r in runs], runs[0][1], runs[0][2]))
        print(f"perplexity {variant.name:40} {fmt(variant.density)} "
              f"{' '.join(f'{r[0]:.4g}' for r in runs)}  values/call {runs[0][1]:.0f}",
              flush=True)
    return outcomes


# -- the report ------------------------------------------------------------------------------


def find(outcomes: list[Any], name: str, density: float | None) -> Any:
    return next((o for o in outcomes if o.variant.name == name
                 and o.variant.density == density), None)


def whole(value: float) -> str:
    """A table cell rounded to a whole number, '-' for no value."""
    return "-" if not math.isfinite(value) else f"{value:.0f}"


def percent(value: float, against: float) -> str:
    return f"{(value / against - 1) * 100:+.1f}%"


def faster(outcomes: list[Any], o: Any, seconds: Callable[[Any], float]) -> str:
    """The cells `x faster than none | vs Top-K (same density)` of `o`'s row: the uncompressed
    row's `seconds` and Top-K's (EF14, `o`'s density) over `o`'s."""
    top = find(outcomes, "topk, ef14", o.variant.density)
    against_top = fmt(gain(top, o, seconds)) + "x" if top and o is not top else "-"
    return f"{fmt(gain(find(outcomes, 'none', None), o, seconds))} | {against_top}"


def allreduce_table(calls: list[CallOutcome]) -> list[str]:
    lines = ["| compressor | density | all-reduce ms (median) | x faster than none | vs Top-K "
             "(same density) | KiB sent by a worker | inner all-reduces |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for o in calls:
        lines.append(
            f"| {o.variant.name} | {fmt(o.variant.density)} | {whole(o.seconds * 1000)} | "
            f"{faster(calls, o, lambda c: c.seconds)} | {o.sent / 1024:.0f} | {o.inner_calls} |")
    return lines


def step_table(steps: list[StepOutcome]) -> list[str]:
    lines = ["| compressor | density | status | wall-clock per step ms | x faster than none | "
             "vs Top-K (same density) | all-reduce ms | compute ms | KiB sent per step | "
             "payload ratio |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for o in steps:
        lines.append(
            f"| {o.variant.name} | {fmt(o.variant.density)} | {o.status} | "
            f"{whole(o.step_seconds * 1000)} | {faster(steps, o, lambda s: s.step_seconds)} | "
            f"{whole(o.allreduce_seconds * 1000)} | {whole(o.compute_seconds * 1000)} | "
            f"{whole(o.sent_per_step / 1024)} | {fmt(o.ratio)} |")
    return lines


def metric_table(metrics: list[MetricOutcome]) -> list[str]:
    lines = ["| compressor | density | values sent per call (fraction) | perplexity: mean ± "
             "standard error | vs none | vs Top-K (same density and feedback) | per seed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    base = find(metrics, "none", None)
    for o in metrics:
        mean, error = spread(o.perplexities)
        feedback = o.variant.name.split(", ")[-1].split(" ")[0]
        top = find(metrics, f"topk, {feedback}", o.variant.density)
        against = (percent(mean, spread(top.perplexities)[0])
                   if top is not None and o is not top else "-")
        lines.append(
            f"| {o.variant.name} | {fmt(o.variant.density)} | {o.values:,.0f} "
            f"({o.values / o.numel:.3f}) | {mean:.4g} ± {error:.2g} | "
            f"{percent(mean, spread(base.perplexities)[0]) if base else '-'} | {against} | "
            f"{' '.join(f'{m:.4g}' for m in o.perplexities)} |")
    return lines


def targets(metrics: list[MetricOutcome], steps: list[StepOutcome],
            densities: list[float]) -> list[str]:
    """ARC-Top-K (the paper's projection sketch) against Top-K at the same density and error
    feedback: within 1% of its perplexity (part C's means) and a lower wall-clock per step
    (part B); each other variant tried, and what the diagnostics measure."""
    lines = []
    for i, d in enumerate(densities):
        for feedback in ("ef14", "ef21m") if i == 0 else ("ef14",):
            arc = find(metrics, f"arc_topk, {feedback}", d)
            top = find(metrics, f"topk, {feedback}", d)
            arc_time, top_time = find(steps, "arc_topk, ef14", d), find(steps, "topk, ef14", d)
            if not (arc and top):
                continue
            (mine, mine_error), (theirs, theirs_error) = (spread(arc.perplexities),
                                                         spread(top.perplexities))
            gap = (mine / theirs - 1) * 100
            timed = bool(arc_time and top_time and arc_time.status == top_time.status == "ok")
            faster = timed and arc_time.step_seconds < top_time.step_seconds
            met = gap <= 1.0 and faster
            time_text = (f"{arc_time.step_seconds * 1000:.0f} ms a step against "
                         f"{top_time.step_seconds * 1000:.0f} ms "
                         f"({top_time.step_seconds / arc_time.step_seconds:.2f}x faster)"
                         if timed else "step time not measured")
            lines.append(
                f"- Density {d:g}, {feedback}: ARC-Top-K within 1% of Top-K's perplexity with "
                f"a lower wall-clock per step: {'PASS' if met else 'not met'}: perplexity "
                f"{mine:.4g} ± {mine_error:.2g} against {theirs:.4g} ± {theirs_error:.2g} "
                f"({gap:+.1f}%); {time_text}.")
        for o in metrics:
            if o.variant.density != d or o.variant.name.startswith(("topk", "arc_topk, ")):
                continue
            feedback = o.variant.name.split(", ")[-1].split(" ")[0]
            top = find(metrics, f"topk, {feedback}", d)
            if top is not None:
                lines.append(f"  - {o.variant.name}: {spread(o.perplexities)[0]:.4g} "
                             f"({percent(spread(o.perplexities)[0], spread(top.perplexities)[0])}"
                             f" against Top-K, {feedback}).")
    rows = find(metrics, "exact rows, ef14 (diagnostic)", densities[0])
    coords = find(metrics, "mean per coordinate, ef14 (diagnostic)", densities[0])
    arc = find(metrics, "arc_topk, ef14", densities[0])
    top = find(metrics, "topk, ef14", densities[0])
    if rows and coords and arc and top:
        a, r, c, t = (spread(o.perplexities)[0] for o in (arc, rows, coords, top))
        lines.append(
            f"- Where the gap comes from (density {densities[0]:g}, ef14, part C): picking the "
            f"aggregate's own top coordinates (one shared pattern, no estimate) gives "
            f"{c:.4g} ({percent(c, t)} against Top-K); picking whole rows by their exact "
            f"aggregate energy gives {r:.4g} ({percent(r, t)}): whole rows cost "
            f"{percent(r, c)} against single coordinates; the projection's estimate of those "
            f"energies ({a:.4g}) costs {percent(a, r)} on top.")
    return lines


def report(calls: list[CallOutcome], steps: list[StepOutcome], metrics: list[MetricOutcome],
           run: Run, densities: list[float], train_steps: int, time_steps: int, seeds: int,
           numel: int) -> str:
    job = JOBS[MODEL]
    return "\n".join([
        *run.header("Compression at scale: ARC-Top-K where the paper's claim applies"),
        f"Model: `char-lm` of width {job['width']}, {job['layers']} layers ({numel:,} "
        f"parameters), {job['batch']} windows of 64 characters per worker and step, Adam lr "
        f"{job['optimizer']['adam']['lr']:g}, {WORLD} workers. Densities "
        f"{', '.join(f'{d:g}' for d in densities)} (the paper's: 0.2 in every command line of "
        "its README and in its Table V; 0.08 its hooks' default). ARC-Top-K: the paper's "
        "projection sketch (each weight matrix's rows projected on a shared Gaussian matrix "
        "of 4 columns, the projections summed over the workers, that fraction of every "
        "matrix's rows kept whole, vectors whole); `marginal`: this project's other sketch "
        "(row and column energies, single coordinates). Error feedback: `ef14` (each worker's "
        "own error: the rule of the paper's released runs) or `ef21m` (eta 1, the first step "
        "sent whole: the paper's theory and this project's default). PowerSGD rank 4 per "
        "weight matrix. Top-K keeps each worker's own top coordinates and all-gathers indices "
        "and values.",
        "",
        "## Part A: the all-reduce alone",
        "",
        f"{WORLD} namespaces on a software bridge, every link into a host limited to {RATE} "
        "(host fallback shaping, htb), the ring with each compressor, one worker per namespace "
        f"(threads of one process), a vector of the model's {numel:,} values with its shapes "
        f"(a shared vector plus per-worker noise), {CALLS} calls each; the slowest worker's "
        "call time, median over the calls.",
        "",
        *(allreduce_table(calls) if calls else ["(not run)"]),
        "",
        "## Part B: wall-clock per step in training",
        "",
        f"One `ClusterRun` per row: {WORLD} workers, each a process in its own namespace, "
        f"every link into a worker limited to {RATE} (htb; this kernel has no sch_netem), TCP "
        f"bbr, the ring, {time_steps} steps; the figures are means over the workers and the "
        f"steps from {SKIP} on. A step is compute, then the all-reduce (which also waits for "
        f"the slowest worker: {WORLD} workers share 2 cores), then the update. The machine is "
        "shared with other work: the rows ran one after another, and `compute ms` (the same "
        "work in every row) shows how the load moved between them.",
        "",
        *(step_table(steps) if steps else ["(not run)"]),
        "",
        "## Part C: the final metric over seeds",
        "",
        f"The same job, {train_steps} steps, {WORLD} workers as threads of one process with "
        f"exact means (only the compressors differ), {seeds} seeds from {SEED}; held-out "
        "perplexity after the last step (512 windows of the last 20% of the corpus). `values "
        "sent` counts, per call and worker after the first, the 4-byte words the compressor "
        "puts on the wire: sketch and values (Top-K: indices and values, which its all-gather "
        f"sends to N - 1 = {WORLD - 1} workers, where an all-reduce sends about 2 (N - 1) / N "
        "of its payload). The diagnostics pick their pattern from a dense all-reduce of what "
        "every worker would compress: the rows of largest exact aggregate energy (what the "
        "projection estimates) and the aggregate's own top coordinates (what any one shared "
        "pattern can at best pick).",
        "",
        *(metric_table(metrics) if metrics else ["(not run)"]),
        "",
        "## Targets",
        "",
        *(targets(metrics, steps, densities) or ["- (not enough cells ran to judge)"]),
        "",
        "A difference smaller than about twice the standard errors is within the seeds' "
        "spread.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compression_scale",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="part C's training steps")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="part C's seeds")
    parser.add_argument("--time-steps", type=int, default=TIME_STEPS,
                        help="part B's steps per cell")
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    parser.add_argument("--no-allreduce", action="store_true", help="skip part A")
    parser.add_argument("--no-cluster", action="store_true", help="skip part B")
    parser.add_argument("--no-accuracy", action="store_true", help="skip part C")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    densities = [float(d) for d in args.densities.split(",") if d]
    if args.time_steps <= SKIP:
        parser.error(f"--time-steps: more than {SKIP} (the steps left out of the step time)")
    rows = variants(densities)
    run = Run.start("benchmarks.compression_scale")
    numel = sum(math.prod(shape) for shape in model_shapes())
    calls: list[CallOutcome] = []
    steps: list[StepOutcome] = []
    metrics: list[MetricOutcome] = []

    def write() -> None:
        args.out.write_text(report(calls, steps, metrics, run, densities, args.steps,
                                   args.time_steps, args.seeds, numel))

    if not args.no_allreduce:
        calls = allreduce_part(rows)
        write()
    if not args.no_cluster:
        steps = cluster_part(rows, args.time_steps)
        write()
    if not args.no_accuracy:
        metrics = accuracy_part(rows, args.steps, args.seeds)
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
