"""GPU timing: a CUDA DDP model's step through the lossy hook against plain DDP, and staging.

The step of a DDP model on the GPU with the lossy all-reduce (or the ring) as its
communication hook against plain DDP (gloo's own all-reduce of the CUDA buckets), and what
bringing a CUDA tensor to the host and back costs per MB (`testbed.transport.staging`).

1. DDP: two processes on loopback (each on GPU rank mod the GPUs there are: both on one GPU
   where there is one), an MLP of about `--parameters` parameters, `--steps` steps of a batch
   of 64 (the first WARMUP left out: DDP rebuilds its buckets after the first). Per way, rank
   0's median step (forward, backward with the hook's all-reduce, optimizer; the GPU
   synchronised at the step's end) and its ratio to plain DDP's, and the lowest coverage of
   the hook's calls. Loopback is no shaped link: the figures are the hook's own cost.
2. Staging: `Staged` of a CUDA float32 tensor (into pinned memory, waited for) and `back`
   (to the device, synchronised), per size; milliseconds per MB and GB/s, and the CPU path's
   time for comparison (it copies nothing).

Writes benchmarks/results/gpu.md (`scripts/gpu_check.sh` runs it after the gpu tier).

    .venv/bin/python -m benchmarks.gpu [--parameters 4000000] [--steps 12] [--out PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.report import Run
from testbed.collectives import create
from testbed.collectives.hook import comm_hook
from testbed.transport.staging import Staged

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gpu.md"
WORLD = 2
WARMUP = 2
WIDTH = 1024  # the MLP's input and output width; its hidden width makes the parameter count
BATCH = 64
WAYS = ("plain", "ring", "lossy")
BASE_PORT = 29650  # each way's ports from BASE_PORT + 10 * its index (loopback, this machine)
SIZES_MB = (1, 16, 64, 256)
REPEATS = 5


def ports(way: str) -> dict[str, list[int]]:
    """The way's ports: torch.distributed's store, then per rank the collective's (UDP for
    lossy) and lossy's TCP ones."""
    base = BASE_PORT + 10 * WAYS.index(way)
    return {"store": [base], "collective": [base + 1 + r for r in range(WORLD)],
            "streams": [base + 1 + WORLD + r for r in range(WORLD)]}


def ddp_worker(rank: int, way: str, parameters: int, steps: int, results) -> None:
    """Rank `rank` of a CUDA DDP model, its gradients through `way`; puts its step seconds
    and the lowest coverage of the hook's calls."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    where = ports(way)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{where['store'][0]}",
                            rank=rank, world_size=WORLD)
    collective, coverage = None, [1.0]
    try:
        torch.manual_seed(0)
        hidden = max(1, parameters // (2 * WIDTH))
        net = torch.nn.Sequential(torch.nn.Linear(WIDTH, hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(hidden, WIDTH)).to(device)
        model = DistributedDataParallel(net, device_ids=[device])
        if way != "plain":
            addresses = [("127.0.0.1", port) for port in where["collective"]]
            streams = [("127.0.0.1", port) for port in where["streams"]]
            collective = create(way, rank, WORLD, addresses=addresses,
                                **({"stream_addresses": streams} if way == "lossy" else {}))
            model.register_comm_hook(state=None, hook=comm_hook(
                collective, on_stats=lambda stats: coverage.append(stats.coverage)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(BATCH, WIDTH, device=device)
        seconds = []
        for _ in range(steps):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        results.put((rank, seconds[WARMUP:], min(coverage),
                     sum(p.numel() for p in net.parameters())))
    finally:
        if collective is not None:
            collective.close()
        dist.destroy_process_group()


def ddp_step(way: str, parameters: int, steps: int) -> tuple[float, float, int]:
    """Rank 0's median step seconds, the lowest coverage of any rank's calls, and the model's
    parameter count."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=ddp_worker, args=(rank, way, parameters, steps, results))
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    collected = sorted(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(60)
        if process.exitcode != 0:
            raise RuntimeError(f"{way}: a DDP process exited with {process.exitcode}")
    _, seconds, _, count = collected[0]
    return statistics.median(seconds), min(c for _, _, c, _ in collected), count


def staging_cost(megabytes: int, device: str) -> tuple[float, float]:
    """Median seconds of `Staged(tensor)` and of `back` for a float32 tensor of `megabytes`
    on `device`, the device synchronised after each."""
    tensor = torch.randn(megabytes << 18, device=device)  # 4-byte elements
    to_host, to_device = [], []
    for _ in range(REPEATS + 1):  # the first warms the pinned memory's cache
        started = time.perf_counter()
        staged = Staged(tensor)
        staged_at = time.perf_counter()
        staged.back(staged.host)
        if device == "cuda":
            torch.cuda.synchronize()
        to_host.append(staged_at - started)
        to_device.append(time.perf_counter() - staged_at)
    return statistics.median(to_host[1:]), statistics.median(to_device[1:])


def report(run: Run, steps: dict[str, tuple[float, float, int]],
           staging: dict[tuple[int, str], tuple[float, float]], requested: int) -> str:
    name = torch.cuda.get_device_name(0)
    lines = run.header("GPU: the lossy hook on a CUDA DDP model, and staging", also=(
        f" GPU: {name} ({torch.cuda.device_count()} visible), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}."))
    count = next(iter(steps.values()))[2]
    plain = steps["plain"][0]
    lines += [f"## One DDP step, {WORLD} processes on loopback, {count:,} parameters "
              f"({count * 4 / 2**20:.0f} MB of gradients; asked: {requested:,})", "",
              "| way | step (ms, median) | / plain | coverage (lowest) |",
              "| --- | ---: | ---: | ---: |"]
    for way, (seconds, coverage, _) in steps.items():
        lines.append(f"| {way} | {seconds * 1e3:.1f} | {seconds / plain:.2f} | "
                     f"{coverage:.4f} |")
    lines += ["", "## Staging per MB (float32, median of "
              f"{REPEATS})", "",
              "| size (MB) | device | to the host (ms) | back (ms) | ms per MB, both ways | "
              "GB/s to the host | GB/s back |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (megabytes, device), (to_host, back) in staging.items():
        per_mb = (to_host + back) * 1e3 / megabytes
        rate = (f"{megabytes / 1024 / to_host:.1f} | {megabytes / 1024 / back:.1f}"
                if device == "cuda" else "- | -")
        lines.append(f"| {megabytes} | {device} | {to_host * 1e3:.3f} | {back * 1e3:.3f} | "
                     f"{per_mb:.3f} | {rate} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=4_000_000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu: needs CUDA (torch.cuda.is_available() is False)")
    if args.steps <= WARMUP:
        sys.exit(f"--steps: expected more than the {WARMUP} warm-up steps, got {args.steps}")
    run = Run.start("benchmarks.gpu")
    steps = {way: ddp_step(way, args.parameters, args.steps) for way in WAYS}
    staging = {(megabytes, device): staging_cost(megabytes, device)
               for megabytes in SIZES_MB for device in ("cuda", "cpu")}
    text = report(run, steps, staging, args.parameters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
