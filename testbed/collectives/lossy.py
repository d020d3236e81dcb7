"""The lossy all-reduce (after Weintraub, Banner and Orda, "Distributed Training under Packet
Loss"): gradients and parameters travel as datagrams, and nobody waits for what was lost.

The flat tensor is cut into `world` shards (`torch.tensor_split`, as the ring does); rank k owns
shard k. One call has two phases:

1. gather: every worker sends its slice of shard k to owner k as datagrams. The owner waits
   until all of them came or its adaptive deadline passed, then takes per chunk the mean of the
   contributions that came (its own always does): `estimate.ChunkAccumulator`.
2. broadcast: the owner sends its result to every worker as datagrams: the averaged shard
   (`allreduce`) or the fresh parameters its optimizer made from it (`step`), with each
   chunk's contribution count appended so receivers know their coverage. A worker that misses
   a chunk keeps its own value there (its gradient, or its stale parameters) until a later
   broadcast overwrites it: copies lag where broadcasts were lost, they never diverge. Options
   narrow that: XOR parity chunks that rebuild a lost chunk (`parity`), a request for what
   did not come (`resend`), and for parameters a best estimate in place of the stale value
   (`missed`).

Chunks land where they belong as they are read, with no per-peer copies: gradient chunks are
added into the owner's running sums, broadcast chunks are written into the owner's slice of the
result and their counts into a small side buffer. Each phase sends to all peers at once, their
chunks interleaved, so no link gets more than its rate from the others together.

Every `resync_every`-th step the broadcast goes over TCP instead, so all copies equal the
owners' again.

How long a phase waits for a peer depends on where the peer is, so that a peer that computed
longer is not mistaken for a lossy link, nor a lost stream for a slow peer. Every datagram says
which (step, bucket, phase) it belongs to, and a waiting worker says where it is (a PROGRESS
datagram, repeated while it waits). A peer not yet seen at this phase is behind: it is waited
for, up to `straggler_timeout` (training is synchronous: the step waits for the slowest worker,
as gloo would). A peer seen at or past it sent its stream: from its first chunk (or from when
it was seen there) the stream has the phase's transfer deadline (`estimate.AdaptiveDeadline`,
learned from how long recent streams took from first to last chunk), and what has not come by
then was lost. A peer that showed nothing within the timeout is absent: later calls do not
wait for it until a datagram of its arrives again (a preempted or partitioned peer costs one
timeout, not one per step). A call that has everything in hand ends at once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from testbed.collectives.base import AllReduceStats, CollectiveBase, PhaseClock, Update
from testbed.collectives.estimate import AdaptiveDeadline, AdaptiveSettle, ChunkAccumulator
from testbed.collectives.parity import parity_chunks, repair, xor_parity
from testbed.transport.tcp import Listener, StreamMesh
from testbed.transport.tensors import bits, codec_of, values_of
from testbed.transport.udp import PHASES, DatagramEndpoint, Landing, Sink, chunk_count
from testbed.transport.wire import BUCKETS, Codec, Kind

# What a worker's copy holds where it missed a chunk of an owner's parameter broadcast (`step`):
# its stale value, that plus the last per-step update it received there, or that plus the
# update its own optimizer makes of its local gradient there.
MISSED = ("keep", "last_update", "local")


@dataclass(frozen=True)
class SeededLoss:
    """A deterministic test loss model, for unit tests of the numerics only: the receiver
    discards the chunks that a generator seeded by (seed, kind, step, bucket, sender, receiver)
    picks, each with probability `rate`, after the transport delivered them. Real runs lose
    packets on shaped links instead, and never use this."""

    rate: float
    seed: int = 0
    kinds: frozenset[Kind] = frozenset({Kind.GRADIENT, Kind.PARAMETER})

    def lost(
        self, kind: Kind, step: int, bucket: int, sender: int, receiver: int, chunks: int
    ) -> np.ndarray:
        """Which of the `chunks` chunks of one sender's tensor are discarded (a bool each)."""
        if kind not in self.kinds:
            return np.zeros(chunks, dtype=bool)
        seed = [self.seed, int(kind), step, bucket, sender, receiver]
        return np.random.default_rng(seed).random(chunks) < self.rate


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


class Lossy(CollectiveBase):
    """Worker `rank`'s end of the lossy all-reduce among `world` workers; its datagrams go to
    and from `addresses[rank]` (numeric addresses, one per rank)."""

    name = "lossy"

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        addresses: Sequence[tuple[str, int]],
        run_id: int = 0,
        mtu: int = 1500,
        rate: float | None = None,
        rcvbuf: int = 32 << 20,
        deadline_initial: float = 1.0,
        deadline_floor: float = 0.02,
        deadline_ceiling: float = 5.0,
        straggler_timeout: float = 5.0,
        settle: float | str | None = "auto",
        resync_every: int = 0,
        parity: int = 4,
        missed: str = "keep",
        resend: bool = True,
        stream_addresses: Sequence[tuple[str, int]] | None = None,
        congestion: str | None = None,
        timeout: float = 30.0,
        rendezvous_timeout: float = 300.0,
        endpoint: DatagramEndpoint | None = None,
        listener: Listener | None = None,
        test_loss: SeededLoss | None = None,
        rejoining: bool = False,
        key: bytes | None = None,
    ) -> None:
        """`mtu` sizes the datagrams and `rate` (bits/s) paces them (None: unpaced). The
        `deadline_*` bound and seed the transfer deadline (seconds from a peer's first chunk of
        a phase); `straggler_timeout` is how long a peer's first chunk is waited for. With
        `settle` (seconds) ends a phase once every sender's stream has ended and nothing came
        for that long (the rest was lost; None waits to the deadline; "auto" learns it between
        1 and 10 ms from what came late). With `parity` G > 0 every broadcast carries an XOR
        parity chunk per G chunks, from which a receiver rebuilds a chunk that is the only one
        of its group lost. `missed` says what a copy holds where a parameter broadcast chunk
        was missed (`step`; MISSED): its stale value, or that plus the last update it received
        there, or plus its own optimizer's update of its local gradient. With `resend`, a
        worker asks each owner once for the broadcast chunks it lacks, and gets them again
        within the call. The defaults (settle auto, parity 4, resend) are the ones that kept
        training within the accuracy targets under 10-30% loss (docs/training.md). The
        workers meet over TCP at `stream_addresses` (default: `addresses`; TCP ports are apart
        from UDP's), with `congestion` control and `timeout` per message, before the first
        datagram, waiting up to `rendezvous_timeout` for all of them (ranks may arrive minutes
        apart: a DDP script broadcasts its model first); with `resync_every` N > 0, every
        step whose number + 1 is a multiple of N broadcasts there.
        `endpoint` and `listener`, if given, are this rank's already bound sockets (then they
        are at `addresses[rank]` and `stream_addresses[rank]`) and are closed with this object.
        `test_loss` is for tests. A worker `rejoining` a running group (restarted after a
        preemption) skips the TCP meeting, which the others held at their start: its peers'
        sockets are bound already, and it has no TCP streams (so no resync). With `key` (the
        run's), every datagram carries a MAC and every TCP hello proves the key (a given
        `endpoint` or `listener` carries its own)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1}, got {rank}")
        stream_addresses = addresses if stream_addresses is None else stream_addresses
        for name, given in (("addresses", addresses), ("stream_addresses", stream_addresses)):
            if len(given) != world:
                raise ValueError(f"{name}: expected one per rank ({world}), got {len(given)}")
        if not 0 < deadline_floor <= deadline_initial <= deadline_ceiling:
            raise ValueError(
                f"deadline_initial: needs 0 < deadline_floor <= deadline_initial <= "
                f"deadline_ceiling, got {deadline_floor}, {deadline_initial}, {deadline_ceiling}"
            )
        if straggler_timeout <= 0:
            raise ValueError(f"straggler_timeout: expected seconds > 0, got {straggler_timeout}")
        if settle is not None and settle != "auto" and (
                not isinstance(settle, int | float) or settle <= 0):
            raise ValueError(f"settle: expected seconds > 0, 'auto' (learned) or None (wait to "
                             f"the deadline), got {settle!r}")
        if parity < 0:
            raise ValueError(f"parity: expected 0 (none) or the chunks per parity chunk, got "
                             f"{parity}")
        if missed not in MISSED:
            raise ValueError(f"missed: expected one of {', '.join(MISSED)}, got {missed!r}")
        if resync_every < 0:
            raise ValueError(f"resync_every: expected 0 (never) or more, got {resync_every}")
        if rejoining and resync_every:
            raise ValueError("resync_every: a rejoining worker has no TCP streams to resync "
                             "over; use 0")
        self.rank, self.world, self.timeout = rank, world, timeout
        self.resync_every, self.test_loss, self.settle = resync_every, test_loss, settle
        self.straggler_timeout, self.parity, self.missed = straggler_timeout, parity, missed
        self.resend = resend
        # Per phase, the settle learned from late datagrams (settle "auto").
        self._settles = {kind: AdaptiveSettle() for kind in PHASES}
        # missed "last_update": per other owner, the last per-step update received for each
        # element of its shard, and per chunk the steps missed since then.
        self._updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Peers in the order of the rounds: at round i a worker sends to rank + i and hears
        # from rank - i, so reliable broadcasts pair up and never wait on each other.
        self.peers = [(rank + i) % world for i in range(1, world)]
        self.gather_deadline, self.broadcast_deadline, self.repair_deadline = (
            AdaptiveDeadline(floor=deadline_floor, ceiling=deadline_ceiling,
                             initial=deadline_initial)
            for _ in range(3)
        )
        self._step, self._in_step = -1, 0  # calls within one step are numbered (the bucket)
        # Peers that sent nothing in time, with their received-datagram count then: they are
        # not waited for until that count moves.
        self._absent: dict[int, int] = {}
        self._mesh: StreamMesh | None = None  # set below; None only if building it failed
        self._listener = listener
        self._sender: ThreadPoolExecutor | None = None
        self.endpoint = endpoint or DatagramEndpoint(rank, run_id, tuple(addresses[rank]),
                                                     mtu=mtu, rate=rate, rcvbuf=rcvbuf, key=key)
        try:
            for peer in self.peers:
                self.endpoint.add_peer(peer, tuple(addresses[peer]))
            # The TCP mesh (which the resync uses) is also the rendezvous: once it is up, every
            # peer's datagram socket is bound, so no first datagram goes to a port nobody holds
            # yet (the kernel would drop it, and it would count as loss on the link).
            if not rejoining:
                self._listener = listener or Listener(tuple(stream_addresses[rank]),
                                                      congestion=congestion, key=key)
                self._mesh = StreamMesh.open(rank, self._listener, dict(enumerate(
                    stream_addresses)), run_id=run_id, timeout=rendezvous_timeout)
            if resync_every:
                self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"lossy-{rank}-send")
        except BaseException:
            self.close()
            raise

    def peer_moved(self, rank: int, host: str) -> None:
        """A restarted peer at another address: its datagrams go there and are taken only
        from there (the TCP mesh is not used once a peer restarted: no resync then)."""
        self.endpoint.move_peer(rank, host)

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, LossyStats]:
        """The average of `tensor` over the workers, as this worker got it: where a broadcast
        chunk was missed, its own value stands in (coverage says how much of that there is)."""
        flat = tensor.detach().reshape(-1)
        result, stats = self._exchange(flat, flat, step, None)
        return result.view_as(tensor), stats

    def step(
        self, parameters: torch.Tensor, gradient: torch.Tensor, step: int, update: Update
    ) -> tuple[torch.Tensor, LossyStats]:
        """One sharded optimizer step on flat vectors: each owner averages its shard of
        `gradient`, calls `update(start, parameters[shard], averaged)` for its new parameters and
        broadcasts them. Returns this worker's new parameter vector: stale where it missed a
        broadcast chunk, which the next broadcast overwrites."""
        if parameters.shape != gradient.shape or parameters.dim() != 1:
            raise ValueError(f"step: needs flat parameters and gradient of one shape, got "
                             f"{tuple(parameters.shape)} and {tuple(gradient.shape)}")
        return self._exchange(gradient.detach(), parameters.detach(), step, update)

    @property
    def mesh(self) -> StreamMesh | None:
        """The TCP streams to the peers (their counters reach the worker's metrics)."""
        return self._mesh

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        if self._mesh is not None:
            self._mesh.close()
        if self._listener is not None:
            self._listener.close()
        self.endpoint.close()

    # -- one call -------------------------------------------------------------------------

    def _exchange(
        self, contribution: torch.Tensor, fallback: torch.Tensor, step: int,
        update: Update | None,
    ) -> tuple[torch.Tensor, LossyStats]:
        """Gather `contribution`'s shards at their owners, broadcast what the owners make of
        them (the mean, or `update` of `fallback`'s shard with it) into a copy of `fallback`.

        Both phases' keys are open before the first datagram goes out, so every chunk lands
        where it belongs as it is read, whenever it comes: a peer's gradient chunks are added
        into this owner's sums, an owner's broadcast chunks are written into its shard of the
        result, their contribution counts into a small side buffer."""
        started = time.monotonic()
        clock = PhaseClock()
        read_before = sum(c.datagrams_received for c in self.endpoint.counters().values())
        self.endpoint.poll()  # read what came since the last call: who is back, what is late
        before = self._counters()
        if step != self._step:
            self._step, self._in_step = step, 0
        bucket = self._in_step % BUCKETS  # by step, not by call: a rejoining worker agrees
        self._in_step += 1
        self._notice_returns(before.received)
        codec = codec_of(contribution.dtype)
        chunk_numel = self.endpoint.chunk_numel(codec)
        shards = torch.tensor_split(contribution, self.world)
        sizes = [shard.numel() for shard in shards]
        starts = [0, *np.cumsum(sizes).tolist()]
        mine = slice(starts[self.rank], starts[self.rank + 1])
        result = fallback.clone()  # where a broadcast chunk is missed, this value stands
        broadcast_numel = self.endpoint.chunk_numel(codec_of(result.dtype))
        # sums in float32 at least (bfloat16 has no numpy type, and more bits cost nothing)
        accumulator = ChunkAccumulator(sizes[self.rank], chunk_numel, dtype=torch.promote_types(
            contribution.dtype, torch.float32))
        accumulator.add_all(shards[self.rank])
        # Per other owner: the contribution count of each chunk of its shard.
        counts = {owner: torch.zeros(chunk_count(sizes[owner], broadcast_numel),
                                     dtype=result.dtype) for owner in self.peers}
        reliable = self.resync_every > 0 and (step + 1) % self.resync_every == 0

        gather_keep = self._open(Kind.GRADIENT, step, bucket, {
            peer: _Accumulating(accumulator, codec) for peer in self.peers})
        group = 0 if reliable else self.parity
        # Per other owner, where its broadcast lands: its shard of the result and its counts,
        # then with parity the padding to a whole chunk and the parity chunks.
        parities = {owner: self._parity_buffer(
            sizes[owner] + counts[owner].numel(), broadcast_numel, group, result.dtype)
            for owner in self.peers}
        landings = {owner: Landing([result[starts[owner]:starts[owner + 1]], counts[owner],
                                    *parities[owner]], broadcast_numel)
                    for owner in self.peers}
        broadcast_keep = {} if reliable else self._open(Kind.PARAMETER, step, bucket, landings)
        try:
            clock.lap("prepare")
            self.endpoint.send_tensors(Kind.GRADIENT, step, bucket,
                                       {peer: shards[peer] for peer in self.peers})
            clock.lap("gather_send")
            gather_deadline = self.gather_deadline.seconds
            gather_arrived = self._collect(Kind.GRADIENT, step, bucket, gather_keep, started,
                                           gather_deadline, self.gather_deadline)
            clock.lap("gather_wait")
            gather_ended = time.monotonic()
            own = result[mine]
            if update is None:
                accumulator.mean(out=own)
            else:
                averaged = accumulator.mean(out=accumulator.total).to(contribution.dtype)
                own.copy_(update(starts[self.rank], fallback[mine], averaged))
            own_counts = accumulator.weight.to(result.dtype)
            clock.lap("reduce")

            broadcasting = time.monotonic()
            broadcast_deadline = 0.0 if reliable else self.broadcast_deadline.seconds
            if reliable:
                broadcast_arrived = self._broadcast_reliably(
                    result, counts, own_counts, step, bucket, starts, broadcast_numel)
            else:
                message = (own, own_counts, *self._with_parity(own, own_counts, broadcast_numel,
                                                               group))
                self.endpoint.send_tensors(Kind.PARAMETER, step, bucket,
                                           dict.fromkeys(self.peers, message))
                clock.lap("broadcast_send")
                broadcast_arrived = self._collect(
                    Kind.PARAMETER, step, bucket, broadcast_keep, broadcasting,
                    broadcast_deadline, self.broadcast_deadline)
            clock.lap("broadcast_wait")
            broadcast = time.monotonic()
            rebuilt = resent = 0
            data_chunks = {owner: chunk_count(sizes[owner] + counts[owner].numel(),
                                              broadcast_numel) for owner in self.peers}
            if group:
                for owner, (_, parity) in parities.items():
                    rebuilt += len(repair(landings[owner], broadcast_arrived[owner],
                                          bits(parity).reshape(-1, broadcast_numel),
                                          data_chunks[owner], group))
            if self.resend and not reliable:
                resent = self._resend(step, bucket, landings, broadcast_arrived, message,
                                      data_chunks,
                                      chunk_count(own.numel() + own_counts.numel(),
                                                  broadcast_numel))
            clock.lap("repair")
        finally:  # a call that failed leaves no key open to land in its tensors
            self.endpoint.close_key(Kind.GRADIENT, step, bucket)
            self.endpoint.close_key(Kind.PARAMETER, step, bucket)

        if update is not None and self.missed != "keep":
            self._stand_in(result, fallback, contribution, broadcast_arrived, starts,
                           broadcast_numel, update)

        # Per chunk of each other owner's shard: how many workers' values are in `result` there.
        contributions = {}
        stand_in = 0.0 if update is not None else 1.0  # stale parameters, or the own value
        typical = accumulator.weight.mean().item()  # for counts that were lost on the way
        broadcast_missing = {}
        for owner in self.peers:
            contributions[owner], broadcast_missing[owner] = _contributions(
                broadcast_arrived[owner], counts[owner], sizes[owner], broadcast_numel,
                stand_in, typical)
        gather_missing = {peer: accumulator.chunks - int(gather_arrived[peer].sum())
                          for peer in self.peers}

        after = self._counters()
        own_elements = (accumulator.weight * _chunk_lengths(sizes[self.rank], chunk_numel)).sum()
        elements = own_elements.item() + sum(
            (weights * _chunk_lengths(sizes[owner], broadcast_numel)).sum().item()
            for owner, weights in contributions.items())
        own_coverage = accumulator.weight / self.world
        broadcast_chunks = sum(chunk_count(sizes[owner], broadcast_numel)
                               for owner in self.peers)
        absent = tuple(
            peer for peer in self.peers
            if gather_missing[peer] == accumulator.chunks
            and broadcast_missing[peer] == chunk_count(sizes[peer], broadcast_numel)
        )
        missing = {peer: gather_missing[peer] + broadcast_missing[peer] for peer in self.peers}
        late, lost = _delta(after.late, before.late), _delta(after.lost, before.lost)
        clock.lap("finish")
        return result, LossyStats(
            self.name, step, seconds=time.monotonic() - started,
            bytes_sent=after.bytes_sent - before.bytes_sent,
            bytes_received=after.bytes_received - before.bytes_received,
            coverage=elements / (self.world * max(1, contribution.numel())),
            peers_missing=absent,
            extra={
                "gather_seconds": gather_ended - started,
                "broadcast_seconds": broadcast - broadcasting,
                "deadline_seconds": gather_deadline,
                "broadcast_deadline_seconds": broadcast_deadline,
                "shard_coverage": own_elements.item() / self.world / max(1, sizes[self.rank]),
                "broadcast_received": 1.0 - sum(broadcast_missing.values())
                / max(1, broadcast_chunks),
                "chunks_missing": float(sum(missing.values())),
                "datagrams_late": float(sum(late.values())),
                "datagrams_lost": float(sum(lost.values())),
                "rcvbuf_drops": float(after.rcvbuf_drops - before.rcvbuf_drops),
                "resync": float(reliable),
                "peers_absent": float(len(self._absent)),
                "chunks_rebuilt": float(rebuilt),
                "chunks_resent": float(resent),
            },
            chunk_coverage=own_coverage, gathered=gather_arrived, received=broadcast_arrived,
            missing=missing, late=late, lost=lost, phases=clock.phases,
            datagrams_sent=after.datagrams_sent - before.datagrams_sent,
            datagrams_received=sum(after.received.values()) - read_before,
        )

    def _open(self, kind: Kind, step: int, bucket: int, sinks: Mapping[int, Sink | torch.Tensor],
              present: Mapping[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """Open (kind, step, bucket) with a sink per sender (`present`: the chunks in hand
        already, see `DatagramEndpoint.open`); per sender, which of its chunks count (all, but
        for those a test loss model discards: they never reach the sink)."""
        sinks = {sender: Landing([sink], self.endpoint.chunk_numel(codec_of(sink.dtype)))
                 if isinstance(sink, torch.Tensor) else sink for sender, sink in sinks.items()}
        keep = {}
        for sender, sink in sinks.items():
            count = chunk_count(sink.numel, self.endpoint.chunk_numel(sink.codec))
            keep[sender] = np.ones(count, dtype=bool)
            if self.test_loss is not None:
                keep[sender] &= ~self.test_loss.lost(kind, step, bucket, sender, self.rank, count)
        self.endpoint.open(kind, step, bucket, {sender: len(k) for sender, k in keep.items()},
                           into={sender: _Kept(sink, keep[sender]) if not keep[sender].all()
                                 else sink for sender, sink in sinks.items()}, present=present)
        return keep

    def _resend(self, step: int, bucket: int, landings: Mapping[int, Landing],
                arrived: dict[int, np.ndarray], message: Sequence[torch.Tensor],
                data_chunks: Mapping[int, int], mine: int) -> int:
        """Ask every owner once for the data chunks of its broadcast that this worker lacks (a
        CONTROL message: a bitmap of them, sent even when empty, so no owner waits for it),
        send every peer again what it asked of this worker's broadcast (`message`, of `mine`
        data chunks) as REPAIR datagrams, and land what comes back into `landings`, within the
        repair deadline (learned like the others). `arrived` gets the chunks that came so;
        returns how many."""
        started = time.monotonic()
        asks = {peer: torch.zeros(-(-mine // 8), dtype=torch.uint8) for peer in self.peers}
        ask_keep = self._open(Kind.CONTROL, step, bucket, asks)
        lacking = [owner for owner in self.peers if not arrived[owner][:data_chunks[owner]].all()]
        present = {owner: arrived[owner].copy() for owner in lacking}
        for owner, here in present.items():  # parity chunks are not sent again
            here[data_chunks[owner]:] = True
        repair_keep = self._open(Kind.REPAIR, step, bucket,
                                 {owner: landings[owner] for owner in lacking}, present=present)
        try:
            self.endpoint.send_tensors(Kind.CONTROL, step, bucket, {
                owner: np.packbits(~arrived[owner][:data_chunks[owner]])
                for owner in self.peers})
            deadline = self.repair_deadline.seconds
            asked = self._collect(Kind.CONTROL, step, bucket, ask_keep, started, deadline,
                                  self.repair_deadline, patience=deadline)
            wanted = {peer: np.flatnonzero(np.unpackbits(asks[peer].numpy())[:mine])
                      for peer in self.peers if asked[peer].all()}
            self.endpoint.send_tensors(Kind.REPAIR, step, bucket,
                                       dict.fromkeys(wanted, message), only=wanted)
            self.endpoint.announce(Kind.REPAIR, step, bucket, self.peers)  # all sent
            came = self._collect(Kind.REPAIR, step, bucket, repair_keep, time.monotonic(),
                                 deadline, self.repair_deadline, patience=deadline)
        finally:
            self.endpoint.close_key(Kind.CONTROL, step, bucket)
            self.endpoint.close_key(Kind.REPAIR, step, bucket)
        resent = 0
        for owner, got in came.items():
            resent += int((got & ~arrived[owner]).sum())
            arrived[owner] |= got
        return resent

    def _broadcast_reliably(
        self, result: torch.Tensor, counts: Mapping[int, torch.Tensor], own_counts: torch.Tensor,
        step: int, bucket: int, starts: Sequence[int], chunk_numel: int,
    ) -> dict[int, np.ndarray]:
        """The broadcast over TCP: every owner's shard and counts arrive whole into `result` and
        `counts`, or a TransportError names the peer that failed."""
        assert self._mesh is not None and self._sender is not None
        mesh = self._mesh
        mine = result[starts[self.rank]:starts[self.rank + 1]]
        payload = torch.cat([mine, own_counts])  # resync steps only

        def send_all() -> None:
            for peer in self.peers:
                mesh[peer].send_tensor(payload, kind=Kind.PARAMETER, step=step, bucket=bucket,
                                       timeout=self.timeout)

        sending = self._sender.submit(send_all)
        arrived = {}
        for owner in reversed(self.peers):  # round i hears from rank - i
            shard = result[starts[owner]:starts[owner + 1]]
            length = shard.numel() + counts[owner].numel()
            values = mesh[owner].recv_tensor(kind=Kind.PARAMETER, step=step, bucket=bucket,
                                             timeout=self.timeout,
                                             out=torch.empty(length, dtype=result.dtype))
            shard.copy_(values[:shard.numel()])
            counts[owner].copy_(values[shard.numel():])
            arrived[owner] = np.ones(chunk_count(length, chunk_numel), dtype=bool)
        sending.result()
        return arrived

    def _collect(
        self, kind: Kind, step: int, bucket: int, keep: Mapping[int, np.ndarray],
        started: float, transfer: float, learner: AdaptiveDeadline,
        patience: float | None = None,
    ) -> dict[int, np.ndarray]:
        """Wait for the opened (kind, step, bucket), saying where this worker is meanwhile: a
        present sender that is behind up to `patience` (default `straggler_timeout`) after
        `started`, an absent one not at all, and each stream for `transfer` seconds from its
        first chunk (or from when its sender was seen past it). Per sender, which of its chunks
        came and count (`keep`). Teaches `learner` how long the streams took; marks who sent
        nothing."""
        patience = self.straggler_timeout if patience is None else patience
        start_by = {sender: started if sender in self._absent
                    else started + patience for sender in keep}
        learned = self._settles[kind]
        collected = self.endpoint.collect(
            kind, step, bucket, None, started + patience + transfer,
            settle=learned.seconds if self.settle == "auto" else self.settle,
            transfer=transfer, start_by=start_by, announce=True)
        first = collected.first_arrivals
        present = [s for s in first if s not in self._absent]
        late = sum(collected.late_from.get(s, 0) for s in present)
        learned.observe(late)
        if present:
            took = max(collected.last_arrivals[s] - first[s] for s in present)
            learner.observe(took, late)
        silent = [s for s in keep if s not in first and s not in collected.reached]
        if silent:
            received = self._counters().received
            for sender in silent:
                self._absent.setdefault(sender, received.get(sender, 0))
        return {sender: collected.arrived[sender] & kept for sender, kept in keep.items()}

    @staticmethod
    def _parity_buffer(numel: int, chunk_numel: int, group: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Where a broadcast of `numel` elements (a shard and its counts) with parity lands
        past them: the padding to a whole chunk, then its parity chunks (nothing without)."""
        if not group:
            return ()
        chunks = chunk_count(numel, chunk_numel)
        return (torch.empty(chunks * chunk_numel - numel, dtype=dtype),
                torch.empty(parity_chunks(chunks, group) * chunk_numel, dtype=dtype))

    @staticmethod
    def _with_parity(own: torch.Tensor, own_counts: torch.Tensor, chunk_numel: int,
                     group: int) -> tuple[torch.Tensor, ...]:
        """What an owner's broadcast carries after its shard and counts: with parity, zero
        padding to a whole chunk and the XOR parity of every `group` chunks."""
        if not group:
            return ()
        numel = own.numel() + own_counts.numel()
        pad = torch.zeros(chunk_count(numel, chunk_numel) * chunk_numel - numel,
                          dtype=own.dtype)
        parity = xor_parity([bits(part) for part in (own, own_counts, pad) if part.numel()],
                            chunk_numel, group)
        return pad, torch.from_numpy(parity.reshape(-1)).view(own.dtype)

    def _stand_in(self, result: torch.Tensor, held: torch.Tensor, gradient: torch.Tensor,
                  arrived: Mapping[int, np.ndarray], starts: Sequence[int], chunk_numel: int,
                  update: Update) -> None:
        """Where this worker missed an owner's chunk, put its best estimate of the owner's new
        parameters instead of the stale ones it holds (`missed`): those plus the last per-step
        update it received there, or plus its own optimizer's update of its local gradient."""
        for owner in self.peers:
            shard = slice(starts[owner], starts[owner + 1])
            numel = shard.stop - shard.start
            came = torch.from_numpy(arrived[owner][:chunk_count(numel, chunk_numel)])
            where = came.repeat_interleave(chunk_numel)[:numel]
            values, before = result[shard], held[shard]
            if self.missed == "local":  # called every step: the local moments stay current
                estimate = update(shard.start, before, gradient[shard])
                values.copy_(torch.where(where, values, estimate))
                continue
            last, behind = self._updates.get(owner, (None, None))
            if last is None or last.numel() != numel:
                last = torch.zeros(numel, dtype=result.dtype)
                behind = torch.zeros(len(came), dtype=result.dtype)
            steps = behind.repeat_interleave(chunk_numel)[:numel]
            # where it came: the owner's update per step since the last one received here
            last = torch.where(where, (values - (before - steps * last)) / (steps + 1), last)
            values.copy_(torch.where(where, values, before + last))
            self._updates[owner] = (last, torch.where(came, 0.0, behind + 1))

    def _notice_returns(self, received: Mapping[int, int]) -> None:
        """An absent peer whose datagrams came again (even late ones) is waited for again."""
        for peer, then in list(self._absent.items()):
            if received.get(peer, 0) > then:
                del self._absent[peer]

    def _counters(self) -> _Counters:
        datagrams = self.endpoint.counters()
        streams = self._mesh.counters() if self._mesh is not None else {}
        return _Counters(
            bytes_sent=sum(c.bytes_sent for c in [*datagrams.values(), *streams.values()]),
            bytes_received=sum(c.bytes_received
                               for c in [*datagrams.values(), *streams.values()]),
            datagrams_sent=sum(c.datagrams_sent for c in datagrams.values()),
            late={peer: c.datagrams_late for peer, c in datagrams.items()},
            lost={peer: c.datagrams_lost for peer, c in datagrams.items()},
            received={peer: c.datagrams_received for peer, c in datagrams.items()},
            rcvbuf_drops=self.endpoint.socket_counters().rcvbuf_drops,
        )


@dataclass(frozen=True)
class _Counters:
    """The transport's cumulative counters at one moment; a call's figures are differences."""

    bytes_sent: int
    bytes_received: int
    datagrams_sent: int
    late: dict[int, int]
    lost: dict[int, int]
    received: dict[int, int]
    rcvbuf_drops: int


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


class _Accumulating:
    """A sink of the gather: a peer's chunks (of `codec`) of this owner's shard are added into
    the accumulator as they are read; no per-peer copy is kept."""

    def __init__(self, accumulator: ChunkAccumulator, codec: Codec) -> None:
        self.accumulator, self.codec = accumulator, codec
        self.numel = accumulator.numel

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        self.accumulator.add_chunks(index, values_of(payload, self.codec))


class _Kept:
    """A sink that passes on only the chunks `keep` marks: what a test loss model did not
    discard."""

    def __init__(self, sink: Sink, keep: np.ndarray) -> None:
        self.sink, self.keep = sink, keep
        self.codec, self.numel = sink.codec, sink.numel

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        kept = self.keep[index]
        if kept.any():
            self.sink.land(index[kept], payload[kept])
