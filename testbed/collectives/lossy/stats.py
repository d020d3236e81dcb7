"""What one lossy call did, from the transport's counters around it and the records of which
chunks came: `LossyStats`, made at the call's end (`summarize`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from testbed.collectives.base import AllReduceStats
from testbed.transport.counters import DatagramCounters
from testbed.transport.tcp import StreamMesh
from testbed.transport.udp import DatagramEndpoint, chunk_count

if TYPE_CHECKING:
    from testbed.collectives.lossy.call import Call

# A call's phases, in the order they run (`LossyStats.phases`; a broadcast that goes reliably
# over TCP, a resync, is timed whole as broadcast_wait).
CALL_PHASES = ("prepare", "gather_send", "gather_wait", "reduce", "broadcast_send",
               "broadcast_wait", "repair", "finish")


@dataclass(repr=False)
class LossyStats(AllReduceStats):
    """AllReduceStats with what the datagrams did in this call. `coverage` counts, per element
    of the result, the owner's contribution count where its broadcast came, and where it was
    missed 1 (the own value, `allreduce`) or 0 (stale parameters, `step`). `chunk_coverage`:
    per chunk of this worker's own shard, the fraction of workers whose contribution came in
    time. Per peer, both phases: `missing` chunks that had not come by the deadline (lost,
    late, malformed or discarded by a test loss model), `late` datagrams that came after their
    call had closed (the deadline was too short), `lost` datagrams that the peer's sequence
    numbers say never came (the transport's count, whatever dropped them). Per chunk, which
    came in time: `gathered[peer]`, of the peer's contribution to this worker's own shard;
    `received[owner]`, of the owner's broadcast (its shard's chunks, then those carrying the
    counts): the records a result can be rebuilt from exactly. `datagrams_sent` and
    `datagrams_received` count the datagrams this call sent and read; `phases` its time per
    phase (CALL_PHASES)."""

    chunk_coverage: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    gathered: dict[int, np.ndarray] = field(default_factory=dict)
    received: dict[int, np.ndarray] = field(default_factory=dict)
    missing: dict[int, int] = field(default_factory=dict)
    late: dict[int, int] = field(default_factory=dict)
    lost: dict[int, int] = field(default_factory=dict)
    datagrams_sent: int = 0
    datagrams_received: int = 0


def datagrams_received(counters: Mapping[int, DatagramCounters]) -> dict[int, int]:
    """Per peer, the datagrams read from it, of a datagram endpoint's `counters()`."""
    return {peer: c.datagrams_received for peer, c in counters.items()}


@dataclass(frozen=True)
class TransportCounters:
    """The transport's cumulative counters at one moment; a call's figures are differences."""

    bytes_sent: int
    bytes_received: int
    datagrams_sent: int
    late: dict[int, int]
    lost: dict[int, int]
    received: dict[int, int]
    rcvbuf_drops: int

    @classmethod
    def of(cls, endpoint: DatagramEndpoint, mesh: StreamMesh | None) -> TransportCounters:
        """Now, of the datagram `endpoint` and the TCP `mesh` (if any)."""
        datagrams = endpoint.counters()
        streams = mesh.counters() if mesh is not None else {}
        return cls(
            bytes_sent=sum(c.bytes_sent for c in [*datagrams.values(), *streams.values()]),
            bytes_received=sum(c.bytes_received
                               for c in [*datagrams.values(), *streams.values()]),
            datagrams_sent=sum(c.datagrams_sent for c in datagrams.values()),
            late={peer: c.datagrams_late for peer, c in datagrams.items()},
            lost={peer: c.datagrams_lost for peer, c in datagrams.items()},
            received=datagrams_received(datagrams),
            rcvbuf_drops=endpoint.socket_counters().rcvbuf_drops,
        )


def summarize(call: Call) -> LossyStats:
    """The finish phase: what `call` did, from the records its phases left; the time this takes
    is the call's last lap."""
    lossy, accumulator, sizes = call.lossy, call.accumulator, call.sizes
    rank, world, peers, numel = lossy.rank, lossy.world, lossy.peers, call.broadcast_numel
    # Per chunk of each other owner's shard: how many workers' values are in the result there.
    contributions = {}
    stand_in = 0.0 if call.update is not None else 1.0  # stale parameters, or the own value
    typical = accumulator.weight.mean().item()  # for counts that were lost on the way
    broadcast_missing = {}
    for owner in peers:
        contributions[owner], broadcast_missing[owner] = _contributions(
            call.broadcast_arrived[owner], call.counts[owner], sizes[owner], numel, stand_in,
            typical)
    gather_missing = {peer: accumulator.chunks - int(call.gather_arrived[peer].sum())
                      for peer in peers}

    before, after = call.before, TransportCounters.of(lossy.endpoint, lossy.mesh)
    own_elements = (accumulator.weight * _chunk_lengths(sizes[rank], call.chunk_numel)).sum()
    elements = own_elements.item() + sum(
        (weights * _chunk_lengths(sizes[owner], numel)).sum().item()
        for owner, weights in contributions.items())
    own_coverage = accumulator.weight / world
    broadcast_chunks = sum(chunk_count(sizes[owner], numel) for owner in peers)
    absent = tuple(
        peer for peer in peers
        if gather_missing[peer] == accumulator.chunks
        and broadcast_missing[peer] == chunk_count(sizes[peer], numel)
    )
    missing = {peer: gather_missing[peer] + broadcast_missing[peer] for peer in peers}
    late, lost = _delta(after.late, before.late), _delta(after.lost, before.lost)
    call.clock.lap("finish")
    return LossyStats(
        lossy.name, call.step, seconds=time.monotonic() - call.started,
        bytes_sent=after.bytes_sent - before.bytes_sent,
        bytes_received=after.bytes_received - before.bytes_received,
        coverage=elements / (world * max(1, call.contribution.numel())),
        peers_missing=absent,
        extra={
            "gather_seconds": call.gather_ended - call.started,
            "broadcast_seconds": call.broadcast_ended - call.broadcast_started,
            "deadline_seconds": call.gather_transfer,
            "broadcast_deadline_seconds": call.broadcast_transfer,
            "shard_coverage": own_elements.item() / world / max(1, sizes[rank]),
            "broadcast_received": 1.0 - sum(broadcast_missing.values())
            / max(1, broadcast_chunks),
            "chunks_missing": float(sum(missing.values())),
            "datagrams_late": float(sum(late.values())),
            "datagrams_lost": float(sum(lost.values())),
            "rcvbuf_drops": float(after.rcvbuf_drops - before.rcvbuf_drops),
            "resync": float(call.reliable),
            "peers_absent": float(lossy.waiting.absent),
            "chunks_rebuilt": float(call.rebuilt),
            "parity_peers": float(len(call.parity_peers)),
            "chunks_resent": float(call.resent),
        },
        chunk_coverage=own_coverage, gathered=call.gather_arrived,
        received=call.broadcast_arrived, missing=missing, late=late, lost=lost,
        phases=call.clock.phases,
        datagrams_sent=after.datagrams_sent - before.datagrams_sent,
        datagrams_received=sum(after.received.values()) - call.read_before,
    )


def _delta(after: Mapping[int, int], before: Mapping[int, int]) -> dict[int, int]:
    return {peer: value - before.get(peer, 0) for peer, value in after.items()
            if value != before.get(peer, 0)}


def _chunk_lengths(numel: int, chunk_numel: int) -> torch.Tensor:
    """Elements in each chunk of a `numel`-element tensor."""
    lengths = torch.full((chunk_count(numel, chunk_numel),), chunk_numel, dtype=torch.float64)
    lengths[-1] = numel - chunk_numel * (len(lengths) - 1)
    return lengths


def _contributions(
    arrived: np.ndarray, counts: torch.Tensor, numel: int, chunk_numel: int, stand_in: float,
    typical: float,
) -> tuple[torch.Tensor, int]:
    """One owner's broadcast (its shard's values, then one contribution count per chunk, in
    `arrived`'s chunks) as this worker got it: the contributions per chunk of the shard now in
    the result (`stand_in` where the chunk was missed; `typical`, an estimate, where the chunk
    came but the one carrying its count did not), and how many chunks were missed."""
    arrived = torch.from_numpy(arrived)
    count = chunk_count(numel, chunk_numel)
    shard_arrived = arrived[:count]
    count_arrived = arrived[(numel + torch.arange(count)) // chunk_numel]
    weights = torch.where(count_arrived, counts.to(torch.float64), typical)
    contributions = torch.where(shard_arrived, weights, stand_in)
    return contributions, count - int(shard_arrived.sum())
