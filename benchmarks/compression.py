"""Compression benchmark: compressed all-reduce in training on bandwidth-limited links.

Part 0: the all-reduce alone among four namespaces on the same links, 1M floats per worker:
the bandwidth-bound case, each compressor's call time and bytes against fp32.

Part 1: four workers, each a process in its own network namespace, every link into a worker
rate-limited to 100 Mbit/s (the host kernel's fallback shaping: htb), train the CNN on digits
and the char-level LM over the ring all-reduce, uncompressed (`none`) and with each compressor
of `collective.compressor`: Top-K, Rand-K and ARC-Top-K at one density (EF21M error feedback),
PowerSGD (ours, over the ring), INT8 and INT4 (group-wise, two-step). Every cell is one
`ClusterRun` of a scenario written here. Figures: final held-out accuracy and perplexity, the
bytes each worker sent per step (frame headers included, from the step events), the mean
all-reduce time and step time, and the run's wall time.

Part 2: PowerSGD against its real peer, torch.distributed.algorithms.ddp_comm_hooks'
`powerSGD_hook`, on the same model's real gradients in one process (a one-worker gloo group,
so the approximation alone is measured): relative error of the gradient each one hands the
optimizer, and the values each sends, at the same rank.

Writes benchmarks/results/compression.md.

    .venv/bin/python benchmarks/compression.py [--quick] [--steps N] [--models cnn,char-lm]
        [--kinds none,topk,...] [--density D] [--timeout S] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results" / "compression.md"
WORLD = 4
SEED = 7
RATE = "100mbit"
# arc_topk_x4: ARC-Top-K at WORLD times the density, about Top-K's bytes (Top-K's all-gather
# sends (N - 1) * 8k bytes, ARC-Top-K's all-reduce 2 (N - 1) / N * 4k plus the sketch).
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
}
TIMEOUT = 600.0
QUICK_TIMEOUT = 240.0


def arc_block(density: float) -> int:
    """ARC-Top-K's block: the power of two nearest 1 / density, 8..256 (0.05: 16, 0.01:
    128), so the sketch (n / block values) costs about what the values do."""
    return min(256, max(8, 2 ** round(math.log2(1 / density))))


def compressor(kind: str, density: float) -> dict[str, Any]:
    if kind in ("topk", "randk"):
        return {"kind": kind, "density": density}
    if kind == "arc_topk":  # a sketch no larger than the values: block ~ 1 / density
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
    train_seconds: float = math.nan  # first step start to last step end (no start-up)
    wall: float = math.nan
    ratio: float = math.nan
    error: float = math.nan
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def run_cell(cell: Cell, steps: int, density: float, timeout: float, workdir: Path) -> Outcome:
    import numpy as np

    from testbed.cluster.runner import ClusterRun, RunTimeout
    from testbed.report.run import load_run

    path = workdir / f"{cell.name}.yaml"
    path.write_text(yaml.safe_dump(cell.scenario(steps, density), sort_keys=False))
    run_dir = workdir / cell.name
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
    outcome = Outcome(cell, status, wall=time.monotonic() - started, note=note)
    try:
        run = load_run(run_dir)
    except Exception as error:
        outcome.note += f" (run unreadable: {error})"
        return outcome
    if run.steps:
        outcome.steps = len({event.step for event in run.steps})
        outcome.sent_per_step = float(np.nanmean(run.column("bytes_sent")))
        outcome.allreduce_seconds = float(np.nanmean(run.column("allreduce_seconds")))
        outcome.step_seconds = float(np.nanmean(run.column("step_seconds")))
        ts = run.column("t")
        outcome.train_seconds = float(np.nanmax(ts) - np.nanmin(ts))
        if cell.kind != "none":
            outcome.ratio = float(np.nanmean(run.column("compression_ratio")))
            outcome.error = float(np.nanmean(run.column("compression_error")))
    evaluations = [w.evaluation for w in runner.workers if w.evaluation]
    if status == "ok" and len(evaluations) == WORLD:
        outcome.accuracy = sum(e["accuracy"] for e in evaluations) / WORLD
        outcome.perplexity = sum(e.get("perplexity", math.exp(e["loss"]))
                                 for e in evaluations) / WORLD
        outcome.eval_loss = sum(e["loss"] for e in evaluations) / WORLD
    return outcome


# -- part 0: the all-reduce alone, bandwidth-bound -------------------------------------------


ALLREDUCE_NUMEL = 1_000_000
QUICK_ALLREDUCE_NUMEL = 1_000_000


@dataclass
class CallOutcome:
    kind: str
    seconds: float  # median over the calls of the slowest worker's call time
    sent: float  # bytes rank 0's collective sent in one call
    error: float  # relative error of rank 0's result against the true mean, first call


def allreduce_part(kinds: list[str], numel: int, calls: int,
                   density: float) -> list[CallOutcome]:
    """Each compressor over the ring among four namespaces whose links into every host are
    limited to RATE: `calls` all-reduces of `numel` floats, every worker in a thread inside its
    namespace (torch's kernels release the GIL)."""
    import statistics

    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from lab_collectives import close_all, on_hosts, rings, shape_every_link

    from netem import LinkProfile
    from netem.lab import Lab
    from testbed.collectives.compression import wrap

    generator = torch.Generator().manual_seed(SEED)
    shared = torch.randn(numel, generator=generator)
    inputs = [shared + 0.5 * torch.randn(numel, generator=generator) for _ in range(WORLD)]
    mean = torch.stack(inputs).mean(0)
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
            times, sent, error = [], 0.0, math.nan
            try:
                for call in range(calls):
                    results = on_hosts(lab, [
                        lambda r=r, c=call, g=group: g[r].allreduce(inputs[r], c)
                        for r in range(WORLD)], wait=300)
                    times.append(max(stats.seconds for _, stats in results))
                    sent = float(results[0][1].bytes_sent)
                    if call == 0:
                        error = float(torch.linalg.vector_norm(results[0][0] - mean)
                                      / torch.linalg.vector_norm(mean))
            finally:
                close_all(lab, group)
            outcomes.append(CallOutcome(kind, statistics.median(times), sent, error))
            print(f"all-reduce {kind:9} {outcomes[-1].seconds * 1000:8.1f} ms  "
                  f"{sent / 1024:9.1f} KiB sent  error {error:.3g}", flush=True)
    finally:
        lab.close()
    return outcomes


def allreduce_table(outcomes: list[CallOutcome]) -> list[str]:
    base = next((o for o in outcomes if o.kind == "none"), None)
    lines = ["| compressor | all-reduce ms (median) | x faster than none | KiB sent by a "
             "worker | x fewer bytes | relative error (first call) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for o in outcomes:
        faster = base.seconds / o.seconds if base else math.nan
        fewer = base.sent / o.sent if base and o.sent else math.nan
        lines.append(f"| {o.kind} | {o.seconds * 1000:.1f} | {fmt(faster)} | "
                     f"{o.sent / 1024:.1f} | {fmt(fewer)} | {fmt(o.error)} |")
    return lines


# -- part 2: PowerSGD against torch's hook ---------------------------------------------------


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


def fmt(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        f"{value:.{digits}g}")


def kib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / 1024:.1f}"


def find(outcomes: list[Outcome], model: str, kind: str) -> Outcome | None:
    return next((o for o in outcomes if o.cell.model == model and o.cell.kind == kind), None)


def table(outcomes: list[Outcome], model: str) -> list[str]:
    metric = "accuracy" if model == "cnn" else "perplexity"
    base = find(outcomes, model, "none")
    lines = [f"| compressor | status | steps | held-out {metric} | vs none | payload ratio | "
             "compression error | KiB sent per step | all-reduce ms | x faster all-reduce | "
             "step ms | training s | wall s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             " ---: |"]
    for o in outcomes:
        if o.cell.model != model:
            continue
        value = o.accuracy if model == "cnn" else o.perplexity
        against = base.accuracy if model == "cnn" else base.perplexity if base else math.nan
        change = "-"
        if base is not None and not math.isnan(value) and not math.isnan(against):
            change = (f"{(value - against) * 100:+.1f} pt" if model == "cnn"
                      else f"{(value / against - 1) * 100:+.1f}%")
        speed = (base.allreduce_seconds / o.allreduce_seconds
                 if base is not None and o.allreduce_seconds > 0 else math.nan)
        lines.append(
            f"| {o.cell.kind} | {o.status} | {o.steps} | "
            f"{fmt(value, 4)} | {change} | {fmt(o.ratio)} | {fmt(o.error)} | "
            f"{kib(o.sent_per_step)} | {fmt(o.allreduce_seconds * 1000)} | {fmt(speed)} | "
            f"{fmt(o.step_seconds * 1000)} | {fmt(o.train_seconds)} | {fmt(o.wall)} |")
    return lines


def targets(outcomes: list[Outcome], calls: list[CallOutcome]) -> list[str]:
    lines = []
    base = next((o for o in calls if o.kind == "none"), None)
    int4 = next((o for o in calls if o.kind == "int4"), None)
    if base and int4:
        speed = base.seconds / int4.seconds
        lines.append(
            f"- INT4 >= 3x faster than fp32 on the bandwidth-bound link (part 0, the all-reduce "
            f"alone): {'met' if speed >= 3 else 'not met'}: {speed:.2f}x "
            f"({int4.seconds * 1000:.0f} ms against {base.seconds * 1000:.0f} ms, "
            f"{base.sent / int4.sent:.2f}x fewer bytes). The final metric in training: below.")
    for model in MODELS:
        top = find(outcomes, model, "topk")
        base, int4 = find(outcomes, model, "none"), find(outcomes, model, "int4")
        for arc_kind, label in (("arc_topk", "ARC-Top-K (same density)"),
                                ("arc_topk_x4", f"ARC-Top-K at {WORLD}x density (~ Top-K's "
                                 "bytes)")):
            arc = find(outcomes, model, arc_kind)
            if not (top and arc and top.status == arc.status == "ok"):
                continue
            if model == "cnn":
                gap = (arc.accuracy - top.accuracy) * 100
                within = gap >= -1.0
                quality = f"accuracy {arc.accuracy:.4f} against Top-K's {top.accuracy:.4f} " \
                          f"({gap:+.1f} pt)"
            else:
                gap = (arc.perplexity / top.perplexity - 1) * 100
                within = gap <= 1.0
                quality = f"perplexity {arc.perplexity:.3f} against Top-K's " \
                          f"{top.perplexity:.3f} ({gap:+.1f}%)"
            faster = arc.train_seconds < top.train_seconds
            lines.append(
                f"- {model}, {label} within 1% of Top-K with lower wall time: "
                f"{'met' if within and faster else 'not met'}: {quality}; training "
                f"{arc.train_seconds:.1f} s against {top.train_seconds:.1f} s, all-reduce "
                f"{arc.allreduce_seconds * 1000:.1f} ms against "
                f"{top.allreduce_seconds * 1000:.1f} ms, "
                f"{arc.sent_per_step / top.sent_per_step:.2f}x Top-K's bytes per step.")
        if base and int4 and base.status == int4.status == "ok":
            speed = base.allreduce_seconds / int4.allreduce_seconds
            if model == "cnn":
                gap = (int4.accuracy - base.accuracy) * 100
                within, quality = gap >= -1.0, f"accuracy {gap:+.1f} pt"
            else:
                gap = (int4.perplexity / base.perplexity - 1) * 100
                within, quality = gap <= 1.0, f"perplexity {gap:+.1f}%"
            lines.append(
                f"- {model} training, INT4 >= 3x faster than fp32 with the final metric within "
                "1%: "
                f"{'met' if speed >= 3 and within else 'not met'}: all-reduce {speed:.2f}x "
                f"faster ({int4.allreduce_seconds * 1000:.1f} ms against "
                f"{base.allreduce_seconds * 1000:.1f} ms), bytes sent per step "
                f"{int4.sent_per_step / base.sent_per_step:.3f}x, {quality}.")
    return lines


READING = [
    "Reading the gaps (what the tables above measure, not a claim beyond them):",
    "",
    "- In training, `all-reduce ms` is not the transfer alone: the four workers share two "
    "cores, so a call also waits for the slowest worker's backward pass, and these models are "
    "small (CNN 9,930 values: 58 KiB a step is under 5 ms at 100 Mbit/s). The bytes shrink by "
    "the payload ratio (`KiB sent per step`), the time much less. Part 0 is the "
    "bandwidth-bound case (1M values, the all-reduce alone): there the speed follows the bytes.",
    "- At one density Top-K and ARC-Top-K are not the same budget: Top-K sums the N workers' "
    "different patterns, so its estimate moves up to N k coordinates a step, ARC-Top-K's k. "
    "`arc_topk_x4` (N times the density, about Top-K's bytes) is the like-for-like row.",
    "- ARC-Top-K makes two inner all-reduces (sketch, then values), 4 (N - 1) sequential ring "
    "hops, where Top-K's all-gather makes N - 1 neighbour exchanges: on a latency-bound "
    "tensor (the CNN) ARC-Top-K's call is the slower one whatever its bytes.",
]


def report(outcomes: list[Outcome], calls: list[CallOutcome],
           peer: dict[str, dict[str, float]], command: str, started: datetime.datetime,
           elapsed: float, steps: dict[str, int], density: float, numel: int,
           note: str) -> str:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
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
    return "\n".join([
        "# Compressed collectives: ARC-Top-K, Top-K, Rand-K, PowerSGD, INT8, INT4",
        "",
        *([f"**{note}**", ""] if note else []),
        f"Written by `{command}`, started {started:%Y-%m-%d %H:%M} UTC, took "
        f"{elapsed / 60:.1f} min. Machine: {cpu}, `nproc` {os.cpu_count()}, Linux "
        f"{platform.release()}, Python {platform.python_version()}.",
        "",
        "## Part 0: the all-reduce alone",
        "",
        f"{WORLD} namespaces on a software bridge, every link into a host limited to {RATE} "
        "(host fallback shaping, htb), the ring with each compressor, one worker per "
        f"namespace (threads of one process), {numel:,} fp32 values per worker (structured: a "
        "shared vector plus per-worker noise), 3 calls; the slowest worker's call time, "
        "median over the calls. Same compressor settings as part 1.",
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
        f", seed {SEED}. Sparsifiers at density {density:g} (ARC-Top-K: the same fraction "
        f"of blocks of {arc_block(density)}; `arc_topk_x4`: {WORLD}x that density, about "
        "Top-K's bytes, since Top-K gathers N patterns), EF21M eta 1 (EF21: Adam keeps the "
        "momentum); PowerSGD rank 4 (per weight "
        "matrix: the worker gives the parameters' shapes); INT8 and INT4 symmetric, nearest "
        "rounding, 128 values per scale.",
        "",
        "Columns: `held-out` is the mean over the workers after the last step; `payload "
        "ratio` the compressor's payload over fp32 (values, indices, scales, sketch; step "
        "mean); `compression error` ||C(x) - x|| / ||x|| of what a worker compressed (step "
        "mean); `KiB sent per step` what one worker's collective sent on the wire, frame "
        "headers included; `all-reduce ms` the mean time of one compressed all-reduce; "
        "`training s` first to last step event (start-up excluded); `wall s` the whole run, "
        "start-up (namespaces, four torch imports, data) included.",
        "",
        *[line for model in models for line in (f"### {model}", "", *table(outcomes, model),
                                                "")],
        "## Targets",
        "",
        *(targets(outcomes, calls) or ["- (not enough cells ran to judge)"]),
        "",
        *READING,
        "",
        "## PowerSGD against torch's powerSGD_hook",
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--density", type=float)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--no-peer", action="store_true", help="skip part 2")
    parser.add_argument("--no-allreduce", action="store_true", help="skip part 0")
    parser.add_argument("--numel", type=int, help="part 0's values per worker")
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
    command = "python benchmarks/compression.py " + " ".join(sys.argv[1:])
    note = ("Reduced run (--quick or a subset): fewer steps and a higher density than the "
            "full benchmark; read the figures as such." if args.quick or args.steps
            or args.models != ",".join(MODELS) or args.kinds != ",".join(KINDS) else "")
    started, clock = datetime.datetime.now(datetime.UTC), time.monotonic()
    outcomes: list[Outcome] = []
    peer: dict[str, dict[str, float]] = {}
    numel = args.numel or (QUICK_ALLREDUCE_NUMEL if args.quick else ALLREDUCE_NUMEL)
    calls = [] if args.no_allreduce else allreduce_part(kinds, numel, 3, density)

    def write() -> None:
        args.out.write_text(report(outcomes, calls, peer, command, started,
                                   time.monotonic() - clock, steps, density, numel, note))

    write()
    with tempfile.TemporaryDirectory(prefix="compression-bench-") as tmp:
        for model in models:
            for kind in kinds:
                outcome = run_cell(Cell(model, kind), steps[model], density, timeout, Path(tmp))
                outcomes.append(outcome)
                value = outcome.accuracy if model == "cnn" else outcome.perplexity
                print(f"{model:8} {kind:9} {outcome.status:8} metric {fmt(value, 4):>7} "
                      f"sent/step {kib(outcome.sent_per_step):>7} KiB  all-reduce "
                      f"{fmt(outcome.allreduce_seconds * 1000):>6} ms  wall {outcome.wall:.0f} s "
                      f"{outcome.note}", flush=True)
                write()
    if not args.no_peer:
        for model in models:
            peer[model] = powersgd_peer(model, 4, 20 if args.quick else 60)
            print(f"powersgd peer {model}: {peer[model]}", flush=True)
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
