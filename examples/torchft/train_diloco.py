"""torchft's DiLoCo training the testbed's char-level LM: a fault-tolerant trainer from outside
the testbed, run as a scenario's command job over the shaped links.

    pip install -e '.[torchft]'      # torchft and what it needs, beside the project
    testbed run examples/torchft/scenario.yaml

Each worker is one torchft replica group of one process (its own TCPStore and manager server);
worker 0 also runs the lighthouse that forms the quorum. The model, the data, each worker's
shard, the inner optimizer (AdamW) and the outer one (SGD, lr 0.7, momentum 0.9, Nesterov)
are the testbed's own for the same seed (`testbed.train`), so a run here and a scenario with
`strategy: diloco` train the same thing and differ only in whose DiLoCo and whose all-reduce
carry it (`benchmarks.diloco`'s outside reference). Prints one JSON line per step
({"step", "loss", "seconds"}, seconds since training began), the held-out perplexity every
--eval-every steps ({"step", "perplexity", "seconds"}), and at the end {"rank", "perplexity",
"outer_steps", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.coordination import LighthouseServer
from torchft.local_sgd import DiLoCo

from testbed.train.config import TrainConfig
from testbed.train.data import Dataset, Shard
from testbed.train.job import load_dataset
from testbed.train.models import build_model, evaluate, loss_fn
from testbed.train.strategies import build_optimizer


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="inner steps in all")
    parser.add_argument("--inner-steps", type=int, default=50,
                        help="H: inner steps between outer steps (torchft's sync_every)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's")
    parser.add_argument("--seed", type=int,
                        help="the model's and the data's (default: the scenario's `seed`)")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-samples", type=int, default=512)
    parser.add_argument("--lighthouse-port", type=int, default=29510)
    parser.add_argument("--store-port", type=int, default=29511, help="each worker's own store")
    parser.add_argument("--manager-port", type=int, default=29512)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds torchft waits for a quorum or an all-reduce")
    return parser.parse_args()


class AddressedTransport(HTTPTransport):
    """torchft's checkpoint server (a rejoining replica fetches the state from it), advertised
    at this worker's address: torchft's own gives `socket.gethostname()`, the host's name,
    which every worker's network namespace shares and none can reach."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.host = host  # before the server starts: it logs its address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        return f"http://{self.host}:{self._server.socket.getsockname()[1]}/checkpoint/"


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def perplexity(model: torch.nn.Module, data: Dataset, config: TrainConfig) -> float:
    """Held-out perplexity, as the testbed's own job evaluates it."""
    return round(evaluate(model, data, config.eval_samples)["perplexity"], 4)


def main() -> None:
    args = arguments()
    if args.seed is None:  # the seed the testbed's own job would take from the scenario
        args.seed = yaml.safe_load(Path(os.environ["TESTBED_SCENARIO"]).read_text()).get("seed", 0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = os.environ["MASTER_ADDR"]
    own = os.environ["TESTBED_ADDRESSES"].split(",")[rank]
    config = TrainConfig(model="char-lm", batch=args.batch, seed=args.seed, steps=args.steps,
                         strategy="diloco", inner_steps=args.inner_steps,
                         optimizer={"adamw": {"lr": args.lr}}, eval_samples=args.eval_samples)
    torch.set_num_threads(config.threads)
    data = load_dataset(config)
    shard = Shard(len(data.train_y), rank, world, config.seed)
    model = build_model(config.model, data, config.context, config.seed, config.width,
                        config.layers)
    inner = build_optimizer(config.optimizer, list(model.parameters()))
    outer = torch.optim.SGD(model.parameters(), **config.outer.options())

    # The default group only ends the run together: worker 0's lighthouse stays up until
    # every worker has taken its last outer step.
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    lighthouse = (LighthouseServer(bind=f"0.0.0.0:{args.lighthouse_port}", min_replicas=world)
                  if rank == 0 else None)
    store = dist.TCPStore(own, args.store_port, 1, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"worker-{rank}", store_addr=own, store_port=args.store_port, rank=0,
        world_size=1, lighthouse_addr=f"http://{master}:{args.lighthouse_port}",
        port=args.manager_port, hostname=own, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, checkpoint_transport=AddressedTransport(own, timeout),
        init_sync=False)  # every worker builds the same model from the seed: nothing to heal
    started = time.monotonic()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.inner_steps,
                    backup_device=torch.device("cpu"), pin_memory=False):
            for step in range(args.steps):
                batch = shard.batch(step, config.batch)
                loss = loss_fn(model(data.train_x[batch]), data.train_y[batch])
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's hook takes the outer step after every H of these
                emit(step=step, loss=round(loss.item(), 4),
                     seconds=round(time.monotonic() - started, 3))
                if (step + 1) % args.eval_every == 0:
                    emit(step=step, perplexity=perplexity(model, data, config),
                         seconds=round(time.monotonic() - started, 3))
        emit(rank=rank, perplexity=perplexity(model, data, config),
             outer_steps=manager.current_step(), seconds=round(time.monotonic() - started, 3))
        dist.barrier()
    finally:
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()
        del store
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
