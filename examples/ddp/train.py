"""A plain data-parallel training script, written for torchrun: nothing of the testbed in it.

    torchrun --nproc-per-node 4 train.py --steps 30 [--device cuda]

It trains a small classifier on synthetic data (each rank its own shard), with DDP over
torch.distributed's gloo, and prints one JSON line per step (rank 0) and, at the end, a
checksum of its parameters (every rank): replicas that stayed in sync print the same one.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def batches(rank: int, steps: int, batch: int, features: int, classes: int):
    """This rank's shard of a synthetic task: class = argmax of a fixed projection."""
    teacher = torch.Generator().manual_seed(0)
    projection = torch.randn(features, classes, generator=teacher)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(batch, features, generator=data)
        yield x, (x @ projection).argmax(dim=1)


def checksum(model: nn.Module) -> str:
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()[:16]


def main(comm_hook=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1,
                        help="SGD's step size; wide models need a smaller one")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: this rank's GPU (LOCAL_RANK among those it sees)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank = dist.get_rank()
    torch.manual_seed(0)  # every replica starts from the same weights (DDP checks it too)
    features, classes = 32, 10
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
              if args.device == "cuda" else torch.device("cpu"))
    net = nn.Sequential(nn.Linear(features, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, classes)).to(device)
    model = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    if comm_hook is not None:  # a communication hook of the caller's: DDP's own extension point
        model.register_comm_hook(state=None, hook=comm_hook())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    for step, (x, y) in enumerate(batches(rank, args.steps, args.batch, features, classes)):
        optimizer.zero_grad()
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4),
                              "seconds": round(time.monotonic() - started, 3)}), flush=True)
    print(json.dumps({"rank": rank, "checksum": checksum(net),
                      "seconds": round(time.monotonic() - started, 3)}), flush=True)
    # The group goes before the interpreter does: gloo's worker threads let go of their last
    # work (which holds Python objects) on their own time, and one that does it while Python is
    # shutting down aborts the process ("terminate called without an active exception", exit
    # 134). DDP holds the group: with the model gone, the group's destructor joins its threads.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
