"""Compression benchmark: compressed all-reduce in training on bandwidth-limited links.

Part 0: the all-reduce alone among four namespaces on the same links, 1M floats per worker
(the bandwidth-bound case) and the CNN's 9,930 (latency-bound): each compressor's call time,
bytes and inner all-reduces against fp32.

Part 1: four workers, each a process in its own network namespace, every link into a worker
rate-limited to 100 Mbit/s (the host kernel's fallback shaping: htb), train the CNN on digits
and the char-level LM over the ring all-reduce, uncompressed (`none`) and with each compressor
of `collective.compressor`: Top-K, Rand-K and ARC-Top-K at one density (EF21M error feedback),
PowerSGD (ours, over the ring), INT8 and INT4 (group-wise, two-step). Every cell is one
`ClusterRun` of a scenario written here. Figures: final held-out accuracy and perplexity, the
bytes each worker sent per step (frame headers included, from the step events), the mean
all-reduce time and step time, and the run's wall time.

Part 2: what limits ARC-Top-K against Top-K, in one process with exact means over several
seeds: ARC-Top-K as shipped (the paper's projection sketch, EF21M) against variants that each
change one thing (EF14, the aggregate's exact row energies, the marginal sketch, the
aggregate's own top-k).

The large model (over a million parameters) at the paper's densities is
`benchmarks.compression_scale`.

Part 3: PowerSGD against its real peer, torch.distributed.algorithms.ddp_comm_hooks'
`powerSGD_hook`, on the same model's real gradients in one process (a one-worker gloo group,
so the approximation alone is measured): relative error of the gradient each one hands the
optimizer, and the values each sends, at the same rank.

Writes benchmarks/results/compression.md.

    .venv/bin/python -m benchmarks.compression [--quick] [--steps N] [--models cnn,char-lm]
        [--kinds none,topk,...] [--density D] [--timeout S] [--sizes N,N] [--seeds N]
        [--no-allreduce] [--no-limits] [--no-peer] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import Run
from benchmarks.scenario_runs import fmt, run_scenario

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compression.md"
WORLD = 4
SEED = 7
RATE = "100mbit"
# arc_topk_x4: ARC-Top-K at WORLD times the density, whose values cost Top-K's bytes (Top-K's
# all-gather sends (N - 1) * 8k bytes, ARC-Top-K's all-reduce 2 (N - 1) / N * 4k), the sketch
# on top.
KINDS = ("none", "topk", "randk", "arc_topk", "arc_topk_x4", "powersgd", "int8", "int4")
MODELS = ("cnn", "char-lm")
STEPS = {"cnn": 150, "char-lm": 150}
QUICK_STEPS = {"cnn": 60, "char-lm": 40}
DENSITY = 0.01
QUICK_DENSITY = 0.05
JOBS = {
    "cnn": {"model": "cnn", "batch": 32, "optimizer": {"adam": {"lr": 3.0e-3}},
            "eval_samples": 512},
    "char-lm": {"model": "char-lm", "batch": 32, "optimizer": {"adam": {"lr": 3.0e-3}},
                "eval_samples": 512, "corpus_chars": 200_000},
    # benchmarks.compression_scale's: 1.28M parameters, bandwidth-bound on 100 Mbit/s
    "char-lm-1m": {"model": "char-lm", "width": 160, "layers": 4, "batch": 8,
                   "optimizer": {"adam": {"lr": 3.0e-3}}, "eval_samples": 512,
                   "corpus_chars": 400_000},
}
TIMEOUT = 600.0
QUICK_TIMEOUT = 240.0
LIMIT_SEEDS = {"cnn": 5, "char-lm": 3}  # part 2 (char-lm's spread over seeds is the smaller)


def arc_block(density: float) -> int:
    """ARC-Top-K's block where it has no shapes (part 0's flat vectors; the cluster worker
    gives the parameters' shapes): the power of two nearest 1 / density, 8..256 (0.05: 16,
    0.01: 128), so the sketch (about n / block values) costs about what the values do."""
    return min(256, max(8, 2 ** round(math.log2(1 / density))))


def compressor(kind: str, density: float) -> dict[str, Any]:
    if kind in ("topk", "randk"):
        return {"kind": kind, "density": density}
    if kind == "arc_topk":
        return {"kind": kind, "density": density, "block": arc_block(density)}
    if kind == "arc_topk_x4":
        return {"kind": "arc_topk", "density": min(1.0, WORLD * density),
                "block": arc_block(density)}
    if kind == "powersgd":
        return {"kind": kind, "rank": 4}
    if kind in ("int8", "int4"):
        return {"kind": kind, "group_size": 128}
    return {"kind": "none"}


@dataclass(frozen=True)
class Cell:
    model: str
    kind: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.kind}"

    def scenario(self, steps: int, density: float) -> dict[str, Any]:
        return {"name": f"compression-{self.name}", "seed": SEED, "workers": WORLD,
                "topology": {"default": {"rate": RATE}, "congestion": "bbr"},
                "job": {**JOBS[self.model], "steps": steps},
                "collective": {"kind": "ring", "compressor": compressor(self.kind, density)},
                "metrics": {"drift_every": 0}}


@dataclass
class Outcome:
    cell: Cell
    status: str
    steps: int = 0
    accuracy: float = math.nan
    perplexity: float = math.nan
    eval_loss: float = math.nan
    sent_per_step: float = math.nan  # bytes one worker sent per step, frame headers included
    allreduce_seconds: float = math.nan
    step_seconds: float = math.nan
    compute_seconds: float = math.nan  # forward and backward of a step: the same work per model
    train_seconds: float = math.nan  # first step start to last step end (no start-up)
    wall: float = math.nan
    ratio: float = math.nan
    error: float = math.nan
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def run_cell(cell: Cell, steps: int, density: float, timeout: float, workdir: Path) -> Outcome:
    """Run the cell's scenario within `timeout`, read its figures from the run."""
    import numpy as np

    ran = run_scenario(cell.scenario(steps, density), cell.name, workdir, timeout)
    outcome = Outcome(cell, ran.status, wall=ran.wall, note=ran.note)
    run = ran.run
    if run is None:
        return outcome
    if run.steps:
        outcome.steps = len({event.step for event in run.steps})
        outcome.sent_per_step = float(np.nanmean(run.column("bytes_sent")))
        outcome.allreduce_seconds = float(np.nanmean(run.column("allreduce_seconds")))
        outcome.step_seconds = float(np.nanmean(run.column("step_seconds")))
        outcome.compute_seconds = float(np.nanmean(run.column("compute_seconds")))
        ts = run.column("t")
        outcome.train_seconds = float(np.nanmax(ts) - np.nanmin(ts))
        if cell.kind != "none":  # (EF21M's first step, the gradient sent whole, left out)
            later = run.column("step") > 0
            outcome.ratio = float(np.nanmean(run.column("compression_ratio")[later]))
            outcome.error = float(np.nanmean(run.column("compression_error")[later]))
    if ran.status == "ok" and len(ran.evaluations) == WORLD:
        evaluations = ran.evaluations
        outcome.accuracy = sum(e["accuracy"] for e in evaluations) / WORLD
        outcome.perplexity = sum(e.get("perplexity", math.exp(e["loss"]))
                                 for e in evaluations) / WORLD
        outcome.eval_loss = sum(e["loss"] for e in evaluations) / WORLD
    return outcome


# -- part 0: the all-reduce alone, bandwidth-bound -------------------------------------------


# 1M values: bandwidth-bound; the CNN's 9,930: latency-bound (sequential ring hops decide).
ALLREDUCE_SIZES = (1_000_000, 9_930)
ALLREDUCE_CALLS = 5


@dataclass
class CallOutcome:
    kind: str
    numel: int
    seconds: float  # median over the calls of the slowest worker's call time
    sent: float  # bytes rank 0's collective sent in one call
    error: float  # relative error of rank 0's result against the true mean, first call
    inner_calls: int  # inner all-reduces in one call (neighbour exchanges not counted)


def allreduce_part(kinds: list[str], sizes: list[int], calls: int,
                   density: float) -> list[CallOutcome]:
    """Each compressor over the ring among four namespaces whose links into every host are
    limited to RATE: `calls` all-reduces of each of `sizes` floats, every worker in a thread
    inside its namespace (torch's kernels release the GIL)."""
    import statistics

    import torch

    from netem import LinkProfile
    from netem.lab import Lab
    from testbed.collectives.compression import wrap
    from testbed.collectives.lab import close_all, on_hosts, rings, shape_every_link

    generator = torch.Generator().manual_seed(SEED)
    outcomes = []
    lab = Lab(WORLD)
    lab.start()
    try:
        shape_every_link(lab, LinkProfile.parse(rate=RATE), backend="fallback")
        for i, kind in enumerate(kinds):
            workers = rings(lab, port=29600 + i, timeout=120)
            spec = compressor(kind, density)
            name = spec.pop("kind")
            group = [wrap(w, name, **spec) for w in workers]
            try:
                for numel in sizes:
                    shared = torch.randn(numel, generator=generator)
                    inputs = [shared + 0.5 * torch.randn(numel, generator=generator)
                              for _ in range(WORLD)]
                    mean = torch.stack(inputs).mean(0)
                    times, error = [], math.nan
                    for call in range(calls):
                        results = on_hosts(lab, [
                            lambda r=r, c=call, g=group, x=inputs: g[r].allreduce(x[r], c)
                            for r in range(WORLD)], wait=300)
                        times.append(max(stats.seconds for _, stats in results))
                        if call == 0:
                            error = float(torch.linalg.vector_norm(results[0][0] - mean)
                                          / torch.linalg.vector_norm(mean))
                    stats = results[0][1]
                    inner = int(stats.extra.get("inner_calls", 1))
                    outcomes.append(CallOutcome(kind, numel, statistics.median(times),
                                                float(stats.bytes_sent), error, inner))
                    print(f"all-reduce {kind:11} {numel:9,} values {times[-1] * 1000:8.1f} ms  "
                          f"{stats.bytes_sent / 1024:9.1f} KiB sent  error {error:.3g}",
                          flush=True)
            finally:
                close_all(lab, group)
    finally:
        lab.close()
    return outcomes


def allreduce_table(outcomes: list[CallOutcome]) -> list[str]:
    lines = ["| values | compressor | all-reduce ms (median) | x faster than none | KiB sent by "
             "a worker | x fewer bytes | inner all-reduces | relative error (first call) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for o in outcomes:
        base = next((b for b in outcomes if b.kind == "none" and b.numel == o.numel), None)
        faster, fewer = gain(base, o, lambda c: c.seconds), gain(base, o, lambda c: c.sent)
        lines.append(f"| {o.numel:,} | {o.kind} | {o.seconds * 1000:.1f} | {fmt(faster)} | "
                     f"{o.sent / 1024:.1f} | {fmt(fewer)} | {o.inner_calls} | {fmt(o.error)} |")
    return lines


# -- part 2: what limits ARC-Top-K, in one process -------------------------------------------


class Group:
    """WORLD workers as threads of this process with exact sums: a barrier per exchange."""

    def __init__(self) -> None:
        import threading

        # A worker that fails breaks the barrier for the others instead of leaving them waiting.
        self.barrier = threading.Barrier(WORLD, timeout=120)
        self.slots: list[Any] = [None] * WORLD

    def exchange(self, rank: int, item: Any) -> list[Any]:
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # every worker has read them before the next exchange
        return items


class LocalCall:
    """What a compressor asks of its inner collective, over a `Group`: exact means."""

    name = "ring"  # exact: agree() sums through allreduce

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, WORLD
        self.inner = self

    def allreduce(self, tensor: Any) -> Any:
        import torch

        return torch.stack(self.group.exchange(self.rank, tensor.float().reshape(-1))).mean(0)

    def all_gather(self, payload: Any) -> list[Any]:
        return self.group.exchange(self.rank, payload)

    def agree(self, sketch: Any) -> Any:
        return self.allreduce(sketch) * WORLD

    def exact_mean(self, tensor: Any) -> Any:
        return self.allreduce(tensor)


def oracles() -> dict[str, type]:
    """ARC-Top-K with patterns from what a sketch can only estimate, each a dense all-reduce
    of x (diagnostics, not compressors): `mean` scores every coordinate by |mean_i x_i| (the
    aggregate's own top-k: the ceiling of any one shared pattern); `rows` keeps the rows of
    largest exact aggregate energy ||mean_i Y_ia||^2 (what the projection estimates: the
    ceiling of whole rows)."""
    import torch

    from testbed.collectives.compression import sparsify as sp

    class MeanSketch(sp.ARCTopK):
        def scores(self, call, x):
            return call.allreduce(x).abs(), x.numel()

    class ExactRows(sp.ARCTopK):
        def pattern(self, call, x, step):
            pieces = sp.projection_layout(self.shapes, x.numel(), self.block)
            mean = call.allreduce(x)
            norms = [mean[start: start + rows * cols].view(rows, cols).norm(dim=1)
                     for start, rows, cols in pieces if cols]  # a "sketch" of rank 1, exact
            sketch = torch.cat(norms) if norms else torch.zeros(0)
            return sp.projection_pattern(sketch, pieces, 1, self.density), x.numel()

    return {"mean": MeanSketch, "rows": ExactRows}


def limits_compressors(density: float) -> dict[str, Any]:
    """The rows of part 2: Top-K, ARC-Top-K as shipped (the projection sketch, EF21M) and
    variants that change one thing."""
    from testbed.collectives.compression.sparsify import ARCTopK, TopK

    oracle = oracles()
    return {
        "topk": lambda: TopK(density=density),
        "topk, ef14": lambda: TopK(density=density, feedback="ef14"),
        "arc_topk": lambda: ARCTopK(density=density),
        "arc_topk, ef14": lambda: ARCTopK(density=density, feedback="ef14"),
        "arc_topk, exact rows": lambda: oracle["rows"](density=density),
        "arc_topk, marginal": lambda: ARCTopK(density=density, sketch="marginal"),
        "arc_topk, mean per coordinate": lambda: oracle["mean"](density=density,
                                                                sketch="marginal"),
    }


@dataclass
class LimitOutcome:
    name: str
    model: str
    metrics: list[float]  # held-out accuracy or perplexity, one per seed
    values: float  # per call and worker: values sent (sketch and pattern's values; indices)
    numel: int  # the model's parameters


def train_in_process(model_name: str, make: Any, steps: int, seed: int,
                     shaped: bool, threads: int = 1) -> tuple[float, float, int]:
    """`steps` steps of the benchmark's job `model_name` with WORLD workers in threads, exact
    means, every worker's compressor from `make` (torch using `threads` threads); the
    held-out metric, the payload values per call of rank 0 (mean over the calls after
    EF21M's first, which sends everything) and the model's parameters."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.nn.utils import parameters_to_vector

    from testbed.train.config import TrainConfig
    from testbed.train.data import Shard
    from testbed.train.job import load_dataset
    from testbed.train.models import build_model, evaluate, loss_fn
    from testbed.train.strategies import write_flat

    torch.set_num_threads(threads)
    spec = JOBS[model_name]
    config = TrainConfig.parse({k: v for k, v in spec.items() if k != "optimizer"}, seed=seed)
    data = load_dataset(config)
    model = build_model(config.model, data, config.context, seed, config.width, config.layers)
    parameters = list(model.parameters())
    optimizer = torch.optim.Adam(parameters, lr=spec["optimizer"]["adam"]["lr"])
    shards = [Shard(len(data.train_y), rank, WORLD, seed) for rank in range(WORLD)]
    compressors = [make() for _ in range(WORLD)]
    for c in compressors:
        if shaped and hasattr(c, "set_shapes"):  # as the cluster worker does
            c.set_shapes([tuple(p.shape) for p in parameters])
    group = Group()
    payload = 0.0
    pool = ThreadPoolExecutor(WORLD)  # one thread per worker: their exchanges meet
    for step in range(steps):
        gradients = []
        for shard in shards:  # the workers hold the same parameters: one model serves all
            for parameter in parameters:
                parameter.grad = None
            batch = shard.batch(step, config.batch)
            loss_fn(model(data.train_x[batch]), data.train_y[batch]).backward()
            gradients.append(parameters_to_vector([p.grad for p in parameters]).detach())
        results = list(pool.map(
            lambda rank, x=gradients, s=step: compressors[rank].reduce(
                LocalCall(group, rank), x[rank], torch.zeros(0), s), range(WORLD)))
        if not all(torch.equal(r[0], results[0][0]) for r in results):
            raise RuntimeError("the workers' estimates differ")
        if step:
            payload += results[0][2]["payload_bytes"] / 4
        for parameter in parameters:  # every worker steps on the same estimate
            parameter.grad = torch.empty_like(parameter)
        write_flat(results[0][0], [p.grad for p in parameters])
        optimizer.step()
    pool.shutdown()
    figures = evaluate(model, data, spec["eval_samples"])
    metric = figures["accuracy"] if config.model == "cnn" else figures.get(
        "perplexity", math.exp(figures["loss"]))
    return metric, payload / max(1, steps - 1), sum(p.numel() for p in parameters)


def limits_part(models: list[str], steps: dict[str, int], density: float,
                seeds: dict[str, int]) -> list[LimitOutcome]:
    outcomes = []
    for model in models:
        for name, make in limits_compressors(density).items():
            runs = [train_in_process(model, make, steps[model], SEED + i, "no shapes" not in name)
                    for i in range(seeds[model])]
            outcomes.append(LimitOutcome(name, model, [r[0] for r in runs], runs[0][1],
                                         runs[0][2]))
            print(f"limits {model:8} {name:34} "
                  f"{' '.join(f'{r[0]:.4g}' for r in runs)}  values/call {runs[0][1]:.0f}",
                  flush=True)
    return outcomes


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def limits_table(outcomes: list[LimitOutcome], model: str) -> list[str]:
    metric = "accuracy" if model == "cnn" else "perplexity"
    top = next((o for o in outcomes if o.model == model and o.name == "topk"), None)
    numel = next(o.numel for o in outcomes if o.model == model)
    lines = [f"| sparsifier | values sent per call (fraction of {numel:,}) | held-out {metric}: "
             "mean ± standard error | vs Top-K | per seed |", "| --- | ---: | ---: | ---: | --- |"]
    for o in outcomes:
        if o.model != model:
            continue
        mean, error = spread(o.metrics)
        against = "-"
        if top is not None and o is not top:
            against = said(model, mean, spread(top.metrics)[0])
        lines.append(f"| {o.name} | {o.values:,.0f} ({o.values / numel:.3f}) | {mean:.4g} ± "
                     f"{error:.2g} | {against} | {' '.join(f'{m:.4g}' for m in o.metrics)} |")
    return lines


# -- part 3: PowerSGD against torch's hook ---------------------------------------------------


def powersgd_peer(model_name: str, rank: int, steps: int) -> dict[str, float]:
    """Our PowerSGD (flat vector as one matrix) and torch's powerSGD_hook (per layer) on the
    gradients of `steps` steps of plain training, one worker: mean relative error of the
    gradient each hands on (steps 3 onwards: both warm-started), values each sends per step."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import parameters_to_vector

    from testbed.collectives.compression.powersgd import PowerSGD
    from testbed.train.config import TrainConfig
    from testbed.train.data import Shard
    from testbed.train.job import load_dataset
    from testbed.train.models import build_model, loss_fn

    torch.set_num_threads(1)
    config = TrainConfig.parse({k: v for k, v in JOBS[model_name].items()
                                if k not in ("optimizer",)}, seed=SEED)
    data = load_dataset(config)
    shard = Shard(len(data.train_y), 0, 1, SEED)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        plain = build_model(model_name, data, config.context, SEED)
        hooked = DistributedDataParallel(build_model(model_name, data, config.context, SEED),
                                         bucket_cap_mb=1000)
        state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, min_compression_rate=0.0,
                                   use_error_feedback=True, warm_start=True)
        hooked.register_comm_hook(state, hook.powerSGD_hook)
        ours = PowerSGD(rank=rank)
        flat = PowerSGD(rank=rank)  # without the shapes: the flat vector as one matrix
        ours.set_shapes([tuple(p.shape) for p in plain.parameters()])

        class Local:  # one worker: the all-reduce is the identity
            @staticmethod
            def allreduce(tensor):
                return tensor.clone()

        optimizer = torch.optim.Adam(plain.parameters(), lr=3e-3)
        errors_ours, errors_flat, errors_torch = [], [], []
        for step in range(steps):
            batch = shard.batch(step, config.batch)
            for net in (plain, hooked):
                net.zero_grad()
                loss_fn(net(data.train_x[batch]), data.train_y[batch]).backward()
            true = parameters_to_vector([p.grad for p in plain.parameters()])
            theirs = parameters_to_vector([p.grad for p in hooked.module.parameters()])
            mine, _, figures = ours.reduce(Local, true, torch.zeros(0), step)
            plain_flat, _, flat_figures = flat.reduce(Local, true, torch.zeros(0), step)
            if step >= 3:
                norm = float(torch.linalg.vector_norm(true))
                errors_ours.append(float(torch.linalg.vector_norm(mine - true)) / norm)
                errors_flat.append(float(torch.linalg.vector_norm(plain_flat - true)) / norm)
                errors_torch.append(float(torch.linalg.vector_norm(theirs - true)) / norm)
            optimizer.step()
            with torch.no_grad():  # both models follow the true gradient's trajectory
                for a, b in zip(hooked.module.parameters(), plain.parameters(), strict=True):
                    a.copy_(b)
        numel = true.numel()
        sent_torch = 0
        for parameter in plain.parameters():
            if parameter.dim() > 1:
                m = parameter.shape[0]
                n = parameter.numel() // m
                sent_torch += (m + n) * min(rank, m, n)
            else:
                sent_torch += parameter.numel()  # torch all-reduces vectors uncompressed
        return {"numel": numel, "ours_error": sum(errors_ours) / len(errors_ours),
                "flat_error": sum(errors_flat) / len(errors_flat),
                "torch_error": sum(errors_torch) / len(errors_torch),
                "ours_values": figures["payload_bytes"] / 4,
                "flat_values": flat_figures["payload_bytes"] / 4, "torch_values": sent_torch}
    finally:
        dist.destroy_process_group()


# -- the report ------------------------------------------------------------------------------


def gain(reference: Any | None, outcome: Any, figure: Callable[[Any], float]) -> float:
    """`reference`'s figure over `outcome`'s: how many times faster (a time) or smaller (bytes)
    `outcome` is; the tables' `x faster` and `x fewer` columns. nan without a reference or a
    positive figure."""
    if reference is None or not figure(outcome) > 0:
        return math.nan
    return figure(reference) / figure(outcome)


def kib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / 1024:.1f}"


def find(outcomes: list[Outcome], model: str, kind: str) -> Outcome | None:
    return next((o for o in outcomes if o.cell.model == model and o.cell.kind == kind), None)


def table(outcomes: list[Outcome], model: str) -> list[str]:
    metric = "accuracy" if model == "cnn" else "perplexity"
    base = find(outcomes, model, "none")
    lines = [f"| compressor | status | steps | held-out {metric} | vs none | payload ratio | "
             "compression error | KiB sent per step | all-reduce ms | x faster all-reduce | "
             "compute ms | step ms | training s | wall s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             " ---: | ---: |"]
    for o in outcomes:
        if o.cell.model != model:
            continue
        value = o.accuracy if model == "cnn" else o.perplexity
        against = (math.nan if base is None
                   else base.accuracy if model == "cnn" else base.perplexity)
        change = "-"
        if base is not None and not math.isnan(value) and not math.isnan(against):
            change = (f"{(value - against) * 100:+.1f} pt" if model == "cnn"
                      else f"{(value / against - 1) * 100:+.1f}%")
        speed = gain(base, o, lambda c: c.allreduce_seconds)
        lines.append(
            f"| {o.cell.kind} | {o.status} | {o.steps} | "
            f"{fmt(value, 4)} | {change} | {fmt(o.ratio)} | {fmt(o.error)} | "
            f"{kib(o.sent_per_step)} | {fmt(o.allreduce_seconds * 1000)} | {fmt(speed)} | "
            f"{fmt(o.compute_seconds * 1000)} | {fmt(o.step_seconds * 1000)} | "
            f"{fmt(o.train_seconds)} | {fmt(o.wall)} |")
    return lines


def limit_mean(limits: list[LimitOutcome], model: str, name: str) -> float:
    found = next((o for o in limits if o.model == model and o.name == name), None)
    return sum(found.metrics) / len(found.metrics) if found else math.nan


def gap(model: str, value: float, against: float) -> float:
    """How much worse `value` is than `against`: accuracy points lost (CNN), percent of
    perplexity gained (char-LM); within 1 is the targets' tolerance."""
    return (against - value) * 100 if model == "cnn" else (value / against - 1) * 100


def said(model: str, value: float, against: float) -> str:
    worse = gap(model, value, against)
    return f"{-worse:+.1f} pt" if model == "cnn" else f"{worse:+.1f}%"


def unit(model: str, error: float, against: float) -> str:
    """A standard error in the unit `said` gives a difference in."""
    return f"{error * 100:.1f} pt" if model == "cnn" else f"{error / against * 100:.1f}%"


def targets(outcomes: list[Outcome], calls: list[CallOutcome],
            limits: list[LimitOutcome]) -> list[str]:
    lines = []
    largest = max((o.numel for o in calls), default=0)
    base = next((o for o in calls if o.kind == "none" and o.numel == largest), None)
    int4 = next((o for o in calls if o.kind == "int4" and o.numel == largest), None)
    if base and int4:
        speed = base.seconds / int4.seconds
        lines.append(
            f"- INT4 >= 3x faster than fp32 on the bandwidth-bound link (part 0, {largest:,} "
            f"values): {'met' if speed >= 3 else 'not met'}: {speed:.2f}x "
            f"({int4.seconds * 1000:.0f} ms against {base.seconds * 1000:.0f} ms, "
            f"{base.sent / int4.sent:.2f}x fewer bytes). The final metric in training: below.")
    for model in MODELS:
        top = find(outcomes, model, "topk")
        base, int4 = find(outcomes, model, "none"), find(outcomes, model, "int4")
        metric = "accuracy" if model == "cnn" else "perplexity"
        for arc_kind, label, limit in (
                ("arc_topk", "ARC-Top-K (same density)", "arc_topk"),
                (f"arc_topk_x{WORLD}", f"ARC-Top-K at {WORLD}x density (Top-K's bytes of values)",
                 f"arc_topk_x{WORLD}")):
            arc = find(outcomes, model, arc_kind)
            if not (top and arc and top.status == arc.status == "ok"):
                continue
            mine = arc.accuracy if model == "cnn" else arc.perplexity
            theirs = top.accuracy if model == "cnn" else top.perplexity
            within = gap(model, mine, theirs) <= 1.0
            faster = arc.train_seconds < top.train_seconds
            seeds = limit_mean(limits, model, limit), limit_mean(limits, model, "topk")
            several = (f"; in part 2 (several seeds, exact means) {said(model, *seeds)}"
                       if not any(math.isnan(v) for v in seeds) else "")
            lines.append(
                f"- {model}, {label} within 1% of Top-K with lower wall time: "
                f"{'met' if within and faster else 'not met'}: {metric} {mine:.4g} against "
                f"Top-K's {theirs:.4g} ({said(model, mine, theirs)}){several}; training "
                f"{arc.train_seconds:.1f} s against {top.train_seconds:.1f} s, all-reduce "
                f"{arc.allreduce_seconds * 1000:.1f} ms against "
                f"{top.allreduce_seconds * 1000:.1f} ms (compute {arc.compute_seconds * 1000:.0f} "
                f"against {top.compute_seconds * 1000:.0f} ms a step), "
                f"{arc.sent_per_step / top.sent_per_step:.2f}x Top-K's bytes per step.")
        if base and int4 and base.status == int4.status == "ok":
            speed = base.allreduce_seconds / int4.allreduce_seconds
            mine = int4.accuracy if model == "cnn" else int4.perplexity
            theirs = base.accuracy if model == "cnn" else base.perplexity
            within = gap(model, mine, theirs) <= 1.0
            lines.append(
                f"- {model} training, INT4 >= 3x faster than fp32 with the final metric within "
                "1%: "
                f"{'met' if speed >= 3 and within else 'not met'}: all-reduce {speed:.2f}x "
                f"faster ({int4.allreduce_seconds * 1000:.1f} ms against "
                f"{base.allreduce_seconds * 1000:.1f} ms), bytes sent per step "
                f"{int4.sent_per_step / base.sent_per_step:.3f}x, {metric} "
                f"{said(model, mine, theirs)}.")
    return lines


def reading(outcomes: list[Outcome], calls: list[CallOutcome],
            limits: list[LimitOutcome]) -> list[str]:
    """The gaps, each with the figures of this run that show its cause."""
    lines = ["Reading the gaps (what the tables measure, not a claim beyond them):", "",
             "- In training, `all-reduce ms` is not the transfer alone: the four workers share "
             "two cores, so a call also waits for the slowest worker's backward pass. Part 0's "
             "largest size is the bandwidth-bound case: there the speed follows the bytes."]
    smallest = min((o.numel for o in calls), default=0)
    small = {o.kind: o for o in calls if o.numel == smallest}
    if {"none", "topk", "arc_topk"} <= set(small):
        lines.append(
            f"- Rounds, not bytes, decide a small tensor's call: at {smallest:,} values (the "
            f"CNN's size) the dense all-reduce took {small['none'].seconds * 1000:.1f} ms "
            f"({small['none'].sent / 1024:.0f} KiB, one ring all-reduce: 2 (N - 1) "
            f"sequential hops), Top-K {small['topk'].seconds * 1000:.1f} ms "
            f"({small['topk'].sent / 1024:.0f} KiB, one all-gather: N - 1 hops), ARC-Top-K "
            f"{small['arc_topk'].seconds * 1000:.1f} ms ({small['arc_topk'].sent / 1024:.0f} "
            f"KiB, {small['arc_topk'].inner_calls} ring all-reduces: the sketch, then the "
            "values). At this size a call costs its sequential rounds, whatever it sends: "
            "ARC-Top-K's second round is what it pays for agreeing on a pattern without "
            "indices.")
    for model in sorted({o.model for o in limits}, key=MODELS.index):
        rows = {o.name: spread(o.metrics) for o in limits if o.model == model}
        if "topk" not in rows:
            continue
        top, top_error = rows.pop("topk")
        lines.append(
            f"- {model}, part 2, against Top-K's {top:.4g} (± {unit(model, top_error, top)}): "
            + "; ".join(f"{name} {said(model, mean, top)} (± {unit(model, error, top)})"
                        for name, (mean, error) in rows.items()) + ".")
    if limits:
        lines.append(
            "- Part 2's rows change one thing each. `mean per coordinate` picks the top-k of "
            "the aggregate itself: what is left of the gap there is what one shared pattern "
            "of k coordinates costs against Top-K's N patterns. `exact rows` picks whole rows "
            "by the aggregate's exact energy: between it and `arc_topk` is the cost of the "
            "projection's estimate, between it and `mean per coordinate` the cost of whole "
            "rows. A difference smaller than about twice the standard errors is within the "
            "seeds' spread.")
    return lines


def report(outcomes: list[Outcome], calls: list[CallOutcome], limits: list[LimitOutcome],
           peer: dict[str, dict[str, float]], run: Run, steps: dict[str, int], density: float,
           seeds: dict[str, int], note: str) -> str:
    peer_lines = ["| model | parameters | rank | torch hook: relative error | ours, per "
                  "weight: relative error | ours, flat: relative error | torch hook: values "
                  "sent | ours, per weight: values sent | ours, flat: values sent |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, figures in peer.items():
        peer_lines.append(
            f"| {model} | {int(figures['numel'])} | 4 | {figures['torch_error']:.3f} | "
            f"{figures['ours_error']:.3f} | {figures['flat_error']:.3f} | "
            f"{int(figures['torch_values'])} | {int(figures['ours_values'])} | "
            f"{int(figures['flat_values'])} |")
    models = sorted({o.cell.model for o in outcomes}, key=MODELS.index)
    limit_models = sorted({o.model for o in limits}, key=MODELS.index)
    sizes = sorted({o.numel for o in calls}, reverse=True)
    return "\n".join([
        *run.header("Compressed collectives: ARC-Top-K, Top-K, Rand-K, PowerSGD, INT8, INT4",
                    note),
        "## Part 0: the all-reduce alone",
        "",
        f"{WORLD} namespaces on a software bridge, every link into a host limited to {RATE} "
        "(host fallback shaping, htb), the ring with each compressor, one worker per "
        f"namespace (threads of one process), {' and '.join(f'{n:,}' for n in sizes)} fp32 "
        "values per worker (structured: a shared vector plus per-worker noise; no shapes, so "
        f"ARC-Top-K's rows are blocks of {arc_block(density)} values), {ALLREDUCE_CALLS} calls "
        "each; the slowest worker's call time, median over the calls. Same densities as part "
        "1.",
        "",
        *(allreduce_table(calls) if calls else ["(not run)"]),
        "",
        "## Part 1: training",
        "",
        f"How: every cell is one `ClusterRun` of a scenario written by the benchmark: {WORLD} "
        f"workers, each a process in its own network namespace, every link into a worker "
        f"limited to {RATE} (host fallback shaping, htb; no loss, no delay: this kernel has "
        "no sch_netem), TCP bbr, the ring all-reduce with the scenario's "
        "`collective.compressor`. Jobs: " + "; ".join(
            f"`{m}` {JOBS[m]['batch']} samples per worker and step, Adam lr "
            f"{JOBS[m]['optimizer']['adam']['lr']:g}, {steps[m]} steps" for m in models) +
        f", seed {SEED}. Sparsifiers at density {density:g} (ARC-Top-K with the paper's "
        "projection sketch: that fraction of every weight matrix's rows, at least one, whole, "
        "picked from the summed projections of the rows on a shared random matrix of 4 "
        "columns, vectors whole, the worker giving the parameters' shapes; "
        f"`arc_topk_x{WORLD}`: {WORLD}x that density, whose values cost what Top-K's indices "
        "and values do, since Top-K gathers N patterns; the sketch comes on top), EF21M eta 1 "
        "(EF21: Adam keeps the momentum; the first step sends the gradients whole); PowerSGD "
        "rank 4 (per weight "
        "matrix: the worker gives the parameters' shapes); INT8 and INT4 symmetric, nearest "
        "rounding, 128 values per scale.",
        "",
        "Columns: `held-out` is the mean over the workers after the last step; `payload "
        "ratio` the compressor's payload over fp32 (values, indices, scales, sketch; mean over "
        "the steps after the first); `compression error` ||C(x) - x|| / ||x|| of what a "
        "worker compressed (the same mean); `KiB sent per step` what one worker's collective "
        "sent on the wire, frame headers included; `all-reduce ms` the mean time of one "
        "compressed all-reduce; `compute ms` a step's forward and backward pass (the same "
        "work in every cell of a model: where it differs, the shared machine's load did, and "
        "every time in that cell with it); "
        "`training s` first to last step event (start-up excluded); `wall s` the whole run, "
        "start-up (namespaces, four torch imports, data) included.",
        "",
        *[line for model in models for line in (f"### {model}", "", *table(outcomes, model),
                                                "")],
        "## Part 2: what limits ARC-Top-K against Top-K",
        "",
        f"One cell of part 1 is one seed; the sparsifiers' held-out figures move by several "
        "points from seed to seed. Here the same jobs, steps and density run with "
        f"{WORLD} workers as threads of one process with exact means (no network: only the "
        "compressors differ), over several seeds (" + ", ".join(
            f"{m}: {seeds[m]}, from {SEED}" for m in limit_models) +
        "), with ARC-Top-K as shipped (the projection sketch, EF21M) and variants that each "
        "change one thing: EF14 instead of EF21M (for Top-K too); the rows of largest exact "
        "aggregate energy (what the projection estimates: a dense all-reduce); the marginal "
        "sketch (row and column energies, single coordinates); every coordinate scored by "
        "|mean_i x_i| (the aggregate's top-k: a dense all-reduce, what a sketch can only "
        "estimate). `values sent` "
        "counts, per call and worker after EF21M's first (which sends everything), what the "
        "sparsifier puts on "
        "the wire as 4-byte words: sketch and values (Top-K: indices and values, sent to "
        f"N - 1 = {WORLD - 1} workers by its all-gather where an all-reduce sends about "
        "2 (N - 1) / N of its payload).",
        "",
        *[line for model in limit_models for line in (
            f"### {model}", "", *limits_table(limits, model), "")],
        *([] if limits else ["(not run)", ""]),
        "## Targets",
        "",
        *(targets(outcomes, calls, limits) or ["- (not enough cells ran to judge)"]),
        "",
        *reading(outcomes, calls, limits),
        "",
        "## Part 3: PowerSGD against torch's powerSGD_hook",
        "",
        "Same model, one worker, the true gradient of each step of plain Adam training fed to "
        "both (torch's through a one-worker DDP with `powerSGD_hook`, rank 4, error "
        "feedback and warm start, compressing from step 2, every matrix compressed); the "
        "relative error of what each hands the optimizer, mean over steps 3 onwards. torch "
        "approximates each weight matrix in its own shape and sends vectors (biases) "
        "uncompressed; ours does the same given the parameters' shapes (as the cluster worker "
        "gives them), and without them views the flat vector as one near-square matrix. "
        "`values sent`: per step and worker, P and Q factors and uncompressed vectors (torch: "
        "counted from the shapes; a matrix with min(rows, cols) <= rank goes uncompressed "
        "in ours, compressed in torch's).",
        "",
        *(peer_lines if peer else ["(not run)"]),
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compression",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--density", type=float)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--no-peer", action="store_true", help="skip part 3")
    parser.add_argument("--no-allreduce", action="store_true", help="skip part 0")
    parser.add_argument("--no-limits", action="store_true", help="skip part 2")
    parser.add_argument("--sizes", help="part 0's values per worker, comma-separated "
                        f"(default {','.join(map(str, ALLREDUCE_SIZES))})")
    parser.add_argument("--seeds", type=int, help="part 2's seeds per model (default: "
                        f"{LIMIT_SEEDS['cnn']} for cnn, {LIMIT_SEEDS['char-lm']} for char-lm)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    kinds = [k for k in args.kinds.split(",") if k]
    for name, given, allowed in (("models", models, MODELS), ("kinds", kinds, KINDS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            parser.error(f"--{name}: unknown {', '.join(bad)}; allowed: {', '.join(allowed)}")
    steps = dict(QUICK_STEPS if args.quick else STEPS)
    if args.steps:
        steps = dict.fromkeys(steps, args.steps)
    density = args.density or (QUICK_DENSITY if args.quick else DENSITY)
    timeout = args.timeout or (QUICK_TIMEOUT if args.quick else TIMEOUT)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else list(ALLREDUCE_SIZES)
    seeds = dict.fromkeys(MODELS, args.seeds) if args.seeds else dict(LIMIT_SEEDS)
    run = Run.start("benchmarks.compression")
    note = ("Reduced run (--quick or a subset): fewer steps, a higher density or fewer cells "
            "than the full benchmark; read the figures as such." if args.quick or args.steps
            or args.models != ",".join(MODELS) or args.kinds != ",".join(KINDS) else "")
    outcomes: list[Outcome] = []
    limits: list[LimitOutcome] = []
    peer: dict[str, dict[str, float]] = {}
    calls = [] if args.no_allreduce else allreduce_part(kinds, sizes, ALLREDUCE_CALLS, density)

    def write() -> None:
        args.out.write_text(report(outcomes, calls, limits, peer, run, steps, density, seeds,
                                   note))

    write()
    with tempfile.TemporaryDirectory(prefix="compression-bench-") as tmp:
        for model in models:
            for kind in kinds:
                outcome = run_cell(Cell(model, kind), steps[model], density, timeout, Path(tmp))
                outcomes.append(outcome)
                value = outcome.accuracy if model == "cnn" else outcome.perplexity
                print(f"{model:8} {kind:11} {outcome.status:8} metric {fmt(value, 4):>7} "
                      f"sent/step {kib(outcome.sent_per_step):>7} KiB  all-reduce "
                      f"{fmt(outcome.allreduce_seconds * 1000):>6} ms  wall {outcome.wall:.0f} s "
                      f"{outcome.note}", flush=True)
                write()
    if not args.no_limits:
        limits = limits_part(models, steps, density, seeds)
        write()
    if not args.no_peer:
        for model in models:
            peer[model] = powersgd_peer(model, 4, 20 if args.quick else 60)
            print(f"powersgd peer {model}: {peer[model]}", flush=True)
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
