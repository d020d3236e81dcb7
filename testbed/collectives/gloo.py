"""torch.distributed's gloo all-reduce: the production baseline the testbed's collectives race.

torch.distributed keeps one default process group per process, so a process holds at most one
`Gloo`; tests run each worker in its own process, never in threads.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from netem.namespace import interface_with
from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.compression.exchange import GlooShift
from testbed.transport.staging import Staged


class Gloo(CollectiveBase):
    """Worker `rank`'s end of a gloo group that meets at `master` (rank 0's TCP store)."""

    name = "gloo"

    def __init__(
        self, rank: int, world: int, *, master: tuple[str, int], timeout: float = 60.0,
        interface_address: str | None = None,
    ) -> None:
        """With `interface_address` (this worker's address), gloo is told to use the interface
        holding it (`GLOO_SOCKET_IFNAME`, unless set already): by itself it picks whatever
        interface the host name resolves to, which in a namespace may be none."""
        if dist.is_initialized():
            raise RuntimeError("gloo: this process already has a torch.distributed group")
        self.rank, self.world, self.timeout = rank, world, timeout
        if interface_address is not None and (iface := interface_with(interface_address)):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        host, port = master
        dist.init_process_group(
            "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout),
        )

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        started = time.monotonic()
        staged = Staged(tensor)
        result = staged.writable()
        dist.all_reduce(result)
        result.div_(self.world)
        return staged.back(result), AllReduceStats(self.name, step,
                                                   seconds=time.monotonic() - started)

    def neighbour_exchange(self) -> GlooShift:
        """isend/irecv on the default group."""
        return GlooShift(self.rank, self.world)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
