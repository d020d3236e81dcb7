"""The reliable ring all-reduce over TCP: the baseline every other collective is measured by.

Reduce-scatter then all-gather around the ring (send to rank+1, receive from rank-1): each
worker sends 2(N-1)/N of the tensor, the bandwidth optimum. TCP retransmits what the link
loses, so the result is exact and loss shows up as time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.transport.staging import Staged
from testbed.transport.tcp import Listener, StreamMesh
from testbed.transport.wire import BUCKETS, Kind


class Ring(CollectiveBase):
    """Worker `rank`'s end of a ring of `world` workers listening at `addresses[rank]`."""

    name = "ring"

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        addresses: Sequence[tuple[str, int]],
        run_id: int = 0,
        timeout: float = 30.0,
        rendezvous_timeout: float = 300.0,
        congestion: str | None = None,
        listener: Listener | None = None,
        key: bytes | None = None,
    ) -> None:
        """`timeout` bounds each send and receive; `rendezvous_timeout` the meeting at the
        start, where ranks may arrive minutes apart (a DDP script broadcasts its model first).
        `listener`, if given, is this rank's already bound socket (then `addresses[rank]` is
        its address, and it carries its own key): binding first lets port 0 pick free ports
        before the addresses are shared. With `key` (the run's), every connection proves it."""
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1}, got {rank}")
        if len(addresses) != world:
            raise ValueError(f"addresses: expected one per rank ({world}), got {len(addresses)}")
        self.rank, self.world, self.timeout = rank, world, timeout
        self.left, self.right = (rank - 1) % world, (rank + 1) % world
        self._calls = 0
        self._listener = listener or Listener(tuple(addresses[rank]), congestion=congestion,
                                              key=key)
        try:
            peers = {self.left, self.right} - {rank}
            self._mesh = StreamMesh.open(
                rank, self._listener, dict(enumerate(addresses)), run_id=run_id, peers=peers,
                timeout=rendezvous_timeout,
            )
        except BaseException:
            self._listener.close()
            raise
        # Sends run beside the receives: two workers blocked sending to each other would
        # otherwise deadlock once their socket buffers fill.
        self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"ring-{rank}-send")

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        started = time.monotonic()
        before = self._totals()
        staged = Staged(tensor)
        flat = staged.writable()
        if self.world > 1:
            bucket = self._calls % BUCKETS
            self._calls += 1
            chunks = torch.tensor_split(flat, self.world)
            incoming = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype)
            for i in range(self.world - 1):  # reduce-scatter
                send, recv = (self.rank - i) % self.world, (self.rank - i - 1) % self.world
                received = self._exchange(chunks[send], incoming[: chunks[recv].numel()],
                                          step, bucket)
                chunks[recv].add_(received)
            for i in range(self.world - 1):  # all-gather: each chunk travels on, complete
                send, recv = (self.rank + 1 - i) % self.world, (self.rank - i) % self.world
                self._exchange(chunks[send], chunks[recv], step, bucket)
            flat.div_(self.world)
        after = self._totals()
        stats = AllReduceStats(
            self.name, step, seconds=time.monotonic() - started,
            bytes_sent=after[0] - before[0], bytes_received=after[1] - before[1],
            extra={"tcp_retransmits": float(after[2])},
        )
        return staged.back(flat), stats

    def _exchange(
        self, outgoing: torch.Tensor, into: torch.Tensor, step: int, bucket: int
    ) -> torch.Tensor:
        """Send `outgoing` to the right while receiving the left neighbour's piece into `into`."""
        sending = self._sender.submit(
            self._mesh[self.right].send_tensor, outgoing, kind=Kind.GRADIENT, step=step,
            bucket=bucket, timeout=self.timeout,
        )
        received = self._mesh[self.left].recv_tensor(
            kind=Kind.GRADIENT, step=step, bucket=bucket, timeout=self.timeout, out=into
        )
        sending.result()
        return received

    def _totals(self) -> tuple[int, int, int]:
        """Bytes sent, bytes received and TCP retransmits (since the streams opened) of the
        ring's sockets, from one read of their counters."""
        counters = self._mesh.counters().values()
        return (
            sum(c.bytes_sent for c in counters),
            sum(c.bytes_received for c in counters),
            sum(c.tcp_retransmits for c in counters),
        )

    @property
    def mesh(self) -> StreamMesh | None:
        """The TCP streams to the peers (their counters reach the worker's metrics)."""
        return self._mesh

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self._mesh.close()
        self._listener.close()
