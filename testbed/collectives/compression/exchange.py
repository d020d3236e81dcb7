"""Point-to-point byte exchange around the ring of ranks, borrowed from the inner collective's
own reliable transport: what Top-K's all-gather, the quantized two-step all-reduce and
ARC-Top-K's sketch agreement over lossy need besides `allreduce`.

`shift(payload, incoming, step)` sends `payload` (uint8) to rank + 1 and returns the
`incoming` bytes rank - 1 sent. Ring: its TCP streams to both neighbours; lossy: its TCP
rendezvous mesh (every peer); gloo: torch.distributed's isend/irecv on the default group.
Each collective offers its own (`neighbour_exchange()`); Moshpit has no fixed neighbours, so
none.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from testbed.transport.wire import BUCKETS, Kind


class Shift(Protocol):
    rank: int
    world: int
    bytes_sent: int
    bytes_received: int

    def shift(self, payload: torch.Tensor, incoming: int, step: int) -> torch.Tensor:
        """Send `payload` (uint8) to rank + 1; the `incoming` bytes from rank - 1."""
        ...

    def close(self) -> None: ...


class MeshShift:
    """Over a `StreamMesh` holding streams to both neighbours (frames of kind CONTROL, so
    they never pass for the collective's own)."""

    def __init__(self, mesh: Any, rank: int, world: int, timeout: float) -> None:
        self.mesh, self.rank, self.world, self.timeout = mesh, rank, world, timeout
        self.left, self.right = (rank - 1) % world, (rank + 1) % world
        self.bytes_sent = self.bytes_received = 0
        self._calls = 0
        self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"shift-{rank}")

    def shift(self, payload: torch.Tensor, incoming: int, step: int) -> torch.Tensor:
        bucket = self._calls % BUCKETS
        self._calls += 1
        before = self._counts()
        sending = self._sender.submit(self.mesh[self.right].send_tensor, payload.contiguous(),
                                      kind=Kind.CONTROL, step=step, bucket=bucket,
                                      timeout=self.timeout)
        received = self.mesh[self.left].recv_tensor(
            kind=Kind.CONTROL, step=step, bucket=bucket, timeout=self.timeout,
            out=torch.empty(incoming, dtype=torch.uint8))
        sending.result()
        after = self._counts()
        self.bytes_sent += after[0] - before[0]
        self.bytes_received += after[1] - before[1]
        return received

    def _counts(self) -> tuple[int, int]:
        right, left = self.mesh[self.right].counters(), self.mesh[self.left].counters()
        if self.left == self.right:
            return right.bytes_sent, right.bytes_received
        return right.bytes_sent, left.bytes_received

    def close(self) -> None:
        self._sender.shutdown(wait=True)


class GlooShift:
    """Over torch.distributed's default (gloo) group; counts payload bytes (gloo's own framing
    is not ours to see)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.left, self.right = (rank - 1) % world, (rank + 1) % world
        self.bytes_sent = self.bytes_received = 0

    def shift(self, payload: torch.Tensor, incoming: int, step: int) -> torch.Tensor:
        import torch.distributed as dist

        received = torch.empty(incoming, dtype=torch.uint8)
        works = [dist.isend(payload.contiguous(), self.right),
                 dist.irecv(received, self.left)]
        for work in works:
            work.wait()
        self.bytes_sent += payload.numel()
        self.bytes_received += incoming
        return received

    def close(self) -> None:
        pass


def mesh_shift(mesh: Any, rank: int, world: int, timeout: float) -> MeshShift | None:
    """An exchange over `mesh` (a `StreamMesh`) if it holds streams to both neighbours, else
    None (no mesh, a single worker, or a mesh that skips a neighbour)."""
    if mesh is None or world == 1:
        return None
    try:
        for peer in {(rank - 1) % world, (rank + 1) % world}:
            mesh[peer]
    except (KeyError, IndexError):
        return None
    return MeshShift(mesh, rank, world, timeout)


def all_gather(shift: Shift, payload: torch.Tensor, step: int) -> list[torch.Tensor]:
    """Every rank's `payload` (all of one size), by rank: N - 1 shifts around the ring, each
    forwarding what came from the left, so each worker sends (N - 1) payloads."""
    gathered: list[torch.Tensor | None] = [None] * shift.world
    gathered[shift.rank] = payload
    current = payload
    for i in range(shift.world - 1):
        current = shift.shift(current, payload.numel(), step)
        gathered[(shift.rank - 1 - i) % shift.world] = current
    return gathered  # type: ignore[return-value]
