"""One call of the lossy all-reduce, phase by phase as CALL_PHASES names them: the algorithm.

prepare (the shards, and where every chunk will land), gather_send and gather_wait (each
worker's slice of every shard to its owner), reduce (the owner's estimate), broadcast_send and
broadcast_wait (what the owners make of it, back to every worker), repair (what parity rebuilds
and a second asking brings of what the broadcast lost), then a stand-in where a parameter
broadcast was still missed, and finish (what the call did: `stats.summarize`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from testbed.collectives import parity
from testbed.collectives.base import PhaseClock, Update
from testbed.collectives.estimate import ChunkAccumulator
from testbed.collectives.lossy.sinks import Accumulating
from testbed.collectives.lossy.stats import (
    LossyStats,
    TransportCounters,
    datagrams_received,
    summarize,
)
from testbed.transport.tensors import bits, codec_of
from testbed.transport.udp import Landing, chunk_count
from testbed.transport.wire import Kind

if TYPE_CHECKING:
    from testbed.collectives.lossy.collective import Lossy


class Call:
    """`lossy`'s call at (step, bucket): `contribution`'s shards gathered at their owners, and
    what the owners make of them (the mean, or `update` of `fallback`'s shard with it)
    broadcast into `result`, a copy of `fallback`. Each phase is the method of its name; what
    the phases record, `finish` tells."""

    def __init__(self, lossy: Lossy, contribution: torch.Tensor, fallback: torch.Tensor,
                 step: int, bucket: int, update: Update | None) -> None:
        self.lossy, self.contribution, self.fallback = lossy, contribution, fallback
        self.step, self.bucket, self.update = step, bucket, update

    def run(self) -> tuple[torch.Tensor, LossyStats]:
        """Every phase in turn: this worker's result, and what the call did."""
        self.prepare()
        try:
            self.gather_send()
            self.gather_wait()
            self.reduce()
            self.broadcast_send()
            self.broadcast_wait()
            self.repair()
        finally:  # a call that failed leaves no key open to land in its tensors
            self.lossy.endpoint.close_key(Kind.GRADIENT, self.step, self.bucket)
            self.lossy.endpoint.close_key(Kind.PARAMETER, self.step, self.bucket)
        self.stand_in()
        return self.result, self.finish()

    def prepare(self) -> None:
        """The shards, and both exchanges' keys open before the first datagram goes out, so
        every chunk lands where it belongs as it is read, whenever it comes: a peer's gradient
        chunks are added into this owner's sums, an owner's broadcast chunks are written into
        its shard of the result, their contribution counts into a small side buffer."""
        lossy, endpoint, step, bucket = self.lossy, self.lossy.endpoint, self.step, self.bucket
        self.started = time.monotonic()
        self.clock = PhaseClock()
        self.read_before = sum(datagrams_received(endpoint.counters()).values())
        endpoint.poll()  # read what came since the last call: who is back, what is late
        self.before = TransportCounters.of(endpoint, lossy.mesh)
        lossy.waiting.notice_returns(self.before.received)
        codec = codec_of(self.contribution.dtype)
        self.chunk_numel = endpoint.chunk_numel(codec)
        self.shards = torch.tensor_split(self.contribution, lossy.world)
        self.sizes = sizes = [shard.numel() for shard in self.shards]
        self.starts = starts = [0, *np.cumsum(sizes).tolist()]
        self.result = result = self.fallback.clone()  # where a broadcast chunk is missed
        self.broadcast_numel = numel = endpoint.chunk_numel(codec_of(result.dtype))
        # sums in float32 at least (bfloat16 has no numpy type, and more bits cost nothing)
        self.accumulator = ChunkAccumulator(sizes[lossy.rank], self.chunk_numel,
                                            dtype=torch.promote_types(self.contribution.dtype,
                                                                      torch.float32))
        self.accumulator.add_all(self.shards[lossy.rank])
        # Per other owner: the contribution count of each chunk of its shard.
        self.counts = {owner: torch.zeros(chunk_count(sizes[owner], numel), dtype=result.dtype)
                       for owner in lossy.peers}
        every = lossy.options.resync_every
        self.reliable = every > 0 and (step + 1) % every == 0
        self.gather_keep = lossy._open(Kind.GRADIENT, step, bucket, {
            peer: Accumulating(self.accumulator, codec) for peer in lossy.peers})
        self.group = 0 if self.reliable else lossy.options.parity
        # Per other owner: its broadcast's data chunks (its shard and counts), and where the
        # broadcast lands: the shard of the result and the counts, then with parity the
        # padding to a whole chunk and the parity chunks, which an owner sends only to peers
        # that saw loss lately (`Lossy.parity_peers`): the short form ends at the data.
        self.data_chunks = {owner: chunk_count(sizes[owner] + self.counts[owner].numel(), numel)
                            for owner in lossy.peers}
        self.parities = {owner: _parity_landing(
            sizes[owner] + self.counts[owner].numel(), numel, self.group, result.dtype)
            for owner in lossy.peers}
        self.landings = {owner: Landing(
            [result[starts[owner]:starts[owner + 1]], self.counts[owner],
             *self.parities[owner]], numel,
            short_count=self.data_chunks[owner] if self.group else None)
            for owner in lossy.peers}
        self.parity_peers: frozenset[int] = frozenset()  # whom this owner's broadcast gives it
        self.broadcast_keep = {} if self.reliable else lossy._open(
            Kind.PARAMETER, step, bucket, self.landings)
        self.clock.lap("prepare")

    def gather_send(self) -> None:
        """This worker's slice of every other owner's shard, to that owner."""
        self.lossy.endpoint.send_tensors(Kind.GRADIENT, self.step, self.bucket, {
            peer: self.shards[peer] for peer in self.lossy.peers})
        self.clock.lap("gather_send")

    def gather_wait(self) -> None:
        """The peers' slices of this worker's shard, added into its sums as they come, until
        the gather's deadline."""
        waiting = self.lossy.waiting
        self.gather_transfer = waiting.gather_deadline.seconds
        self.gather_arrived = waiting.collect(Kind.GRADIENT, self.step, self.bucket,
                                              self.gather_keep, self.started,
                                              self.gather_transfer, waiting.gather_deadline)
        self.clock.lap("gather_wait")
        self.gather_ended = time.monotonic()

    def reduce(self) -> None:
        """This owner's shard of the result: per chunk, the mean of the contributions that
        came, or what `update` makes of it; and how many came (`own_counts`)."""
        rank = self.lossy.rank
        mine = slice(self.starts[rank], self.starts[rank + 1])
        self.own = self.result[mine]
        if self.update is None:
            self.accumulator.mean(out=self.own)
        else:
            averaged = self.accumulator.mean(out=self.accumulator.total).to(
                self.contribution.dtype)
            self.own.copy_(self.update(self.starts[rank], self.fallback[mine], averaged))
        self.own_counts = self.accumulator.weight.to(self.result.dtype)
        self.clock.lap("reduce")

    def broadcast_send(self) -> None:
        """This owner's shard and counts, with parity chunks after them, to every peer (a
        resync's go over TCP, in broadcast_wait)."""
        self.broadcast_started = time.monotonic()
        learned = self.lossy.waiting.broadcast_deadline
        self.broadcast_transfer = 0.0 if self.reliable else learned.seconds
        if self.reliable:
            return
        self.message = full = (self.own, self.own_counts)
        if self.group:
            pad, rows = _parity_message(self.own, self.own_counts, self.broadcast_numel,
                                        self.group)
            self.message = (self.own, self.own_counts, pad)
            self.parity_peers = self.lossy.parity_peers()
            full = (*self.message, rows)
        self.lossy.endpoint.send_tensors(Kind.PARAMETER, self.step, self.bucket, {
            peer: full if peer in self.parity_peers else self.message
            for peer in self.lossy.peers})
        self.clock.lap("broadcast_send")

    def broadcast_wait(self) -> None:
        """The owners' shards and counts, written into the result as they come, until the
        broadcast's deadline (a resync's: whole, over TCP)."""
        waiting = self.lossy.waiting
        if self.reliable:
            self.broadcast_arrived = self._broadcast_reliably()
        else:
            self.broadcast_arrived = waiting.collect(
                Kind.PARAMETER, self.step, self.bucket, self.broadcast_keep,
                self.broadcast_started, self.broadcast_transfer, waiting.broadcast_deadline)
        self.clock.lap("broadcast_wait")
        self.broadcast_ended = time.monotonic()

    def repair(self) -> None:
        """The broadcast chunks that did not come: rebuilt from their parity group where they
        are its only one lost (`rebuilt`), then asked for once and sent again (`resent`)."""
        self.rebuilt = self.resent = 0
        numel, data_chunks = self.broadcast_numel, self.data_chunks
        # whether each owner's broadcast lost data chunks on the way (parity's cue)
        self.lost_from = {owner: not arrived[:data_chunks[owner]].all()
                          for owner, arrived in self.broadcast_arrived.items()}
        if self.group:
            for owner, (_, parity_rows) in self.parities.items():
                self.rebuilt += len(parity.repair(
                    self.landings[owner], self.broadcast_arrived[owner],
                    bits(parity_rows).reshape(-1, numel), data_chunks[owner], self.group))
        if self.lossy.options.resend and not self.reliable:
            self.resent = self._resend(data_chunks, chunk_count(
                self.own.numel() + self.own_counts.numel(), numel))
        self.clock.lap("repair")

    def stand_in(self) -> None:
        """Where this worker missed an owner's chunk of a parameter broadcast, its best
        estimate of the owner's new parameters instead of the stale ones it holds (`missed`):
        those plus the last per-step update it received there, or plus its own optimizer's
        update of its local gradient. Nothing for `allreduce`, nor with `missed` keep."""
        lossy, update, chunk_numel = self.lossy, self.update, self.broadcast_numel
        if update is None or lossy.options.missed == "keep":
            return
        for owner in lossy.peers:
            shard = slice(self.starts[owner], self.starts[owner + 1])
            numel = shard.stop - shard.start
            came = torch.from_numpy(
                self.broadcast_arrived[owner][:chunk_count(numel, chunk_numel)])
            where = came.repeat_interleave(chunk_numel)[:numel]
            values, before = self.result[shard], self.fallback[shard]
            if lossy.options.missed == "local":  # called every step: local moments stay current
                estimate = update(shard.start, before, self.contribution[shard])
                values.copy_(torch.where(where, values, estimate))
                continue
            last, behind = lossy.last_updates.get(owner, (None, None))
            if last is None or last.numel() != numel:
                last = torch.zeros(numel, dtype=self.result.dtype)
                behind = torch.zeros(len(came), dtype=self.result.dtype)
            steps = behind.repeat_interleave(chunk_numel)[:numel]
            # where it came: the owner's update per step since the last one received here
            last = torch.where(where, (values - (before - steps * last)) / (steps + 1), last)
            values.copy_(torch.where(where, values, before + last))
            lossy.last_updates[owner] = (last, torch.where(came, 0.0, behind + 1))

    def finish(self) -> LossyStats:
        """What this call did."""
        return summarize(self)

    def _resend(self, data_chunks: dict[int, int], mine: int) -> int:
        """Ask every owner once for the data chunks of its broadcast that this worker lacks (a
        CONTROL message: a bitmap of them and a byte saying whether any was lost on the way,
        parity or not, sent even when empty, so no owner waits for it), send every peer again
        what it asked of this worker's broadcast (`message`, of `mine` data chunks) as REPAIR
        datagrams, and land what comes back into `landings`, within the repair deadline
        (learned like the others). `broadcast_arrived` gets the chunks that came so; returns
        how many. The peers that said they lost some, or whose ask did not come, get parity
        in the next calls (`Lossy.loss_seen`)."""
        lossy, endpoint, waiting = self.lossy, self.lossy.endpoint, self.lossy.waiting
        step, bucket, arrived = self.step, self.bucket, self.broadcast_arrived
        started = time.monotonic()
        asks = {peer: torch.zeros(-(-mine // 8) + 1, dtype=torch.uint8) for peer in lossy.peers}
        ask_keep = lossy._open(Kind.CONTROL, step, bucket, asks)
        lacking = [owner for owner in lossy.peers
                   if not arrived[owner][:data_chunks[owner]].all()]
        present = {owner: arrived[owner].copy() for owner in lacking}
        for owner, here in present.items():  # parity chunks are not sent again
            here[data_chunks[owner]:] = True
        repair_keep = lossy._open(Kind.REPAIR, step, bucket,
                                  {owner: self.landings[owner] for owner in lacking},
                                  present=present)
        try:
            endpoint.send_tensors(Kind.CONTROL, step, bucket, {
                owner: np.append(np.packbits(~arrived[owner][:data_chunks[owner]]),
                                 np.uint8(self.lost_from[owner]))
                for owner in lossy.peers})
            deadline = waiting.repair_deadline.seconds
            asked = waiting.collect(Kind.CONTROL, step, bucket, ask_keep, started, deadline,
                                    waiting.repair_deadline, patience=deadline)
            wanted = {peer: np.flatnonzero(np.unpackbits(asks[peer].numpy()[:-1])[:mine])
                      for peer in lossy.peers if asked[peer].all()}
            lossy.loss_seen([peer for peer in lossy.peers
                             if peer not in wanted or asks[peer][-1].item()])
            endpoint.send_tensors(Kind.REPAIR, step, bucket,
                                  dict.fromkeys(wanted, self.message), only=wanted)
            endpoint.announce(Kind.REPAIR, step, bucket, lossy.peers)  # all sent
            came = waiting.collect(Kind.REPAIR, step, bucket, repair_keep, time.monotonic(),
                                   deadline, waiting.repair_deadline, patience=deadline)
        finally:
            endpoint.close_key(Kind.CONTROL, step, bucket)
            endpoint.close_key(Kind.REPAIR, step, bucket)
        resent = 0
        for owner, got in came.items():
            resent += int((got & ~arrived[owner]).sum())
            arrived[owner] |= got
        return resent

    def _broadcast_reliably(self) -> dict[int, np.ndarray]:
        """The broadcast over TCP (a resync): every owner's shard and counts arrive whole into
        the result and `counts`, or a TransportError names the peer that failed."""
        lossy = self.lossy
        assert lossy.mesh is not None and lossy._sender is not None
        mesh, starts, result = lossy.mesh, self.starts, self.result
        step, bucket = self.step, self.bucket
        payload = torch.cat([self.own, self.own_counts])  # resync steps only

        def send_all() -> None:
            for peer in lossy.peers:
                mesh[peer].send_tensor(payload, kind=Kind.PARAMETER, step=step, bucket=bucket,
                                       timeout=lossy.timeout)

        sending = lossy._sender.submit(send_all)
        arrived = {}
        for owner in reversed(lossy.peers):  # round i hears from rank - i
            shard = result[starts[owner]:starts[owner + 1]]
            length = shard.numel() + self.counts[owner].numel()
            values = mesh[owner].recv_tensor(kind=Kind.PARAMETER, step=step, bucket=bucket,
                                             timeout=lossy.timeout,
                                             out=torch.empty(length, dtype=result.dtype))
            shard.copy_(values[:shard.numel()])
            self.counts[owner].copy_(values[shard.numel():])
            arrived[owner] = np.ones(chunk_count(length, self.broadcast_numel), dtype=bool)
        sending.result()
        return arrived


def _parity_landing(numel: int, chunk_numel: int, group: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Where a broadcast of `numel` elements (a shard and its counts) with parity lands past
    them: the padding to a whole chunk, then its parity chunks (nothing without)."""
    if not group:
        return ()
    chunks = chunk_count(numel, chunk_numel)
    return (torch.empty(chunks * chunk_numel - numel, dtype=dtype),
            torch.empty(parity.parity_chunks(chunks, group) * chunk_numel, dtype=dtype))


def _parity_message(own: torch.Tensor, own_counts: torch.Tensor, chunk_numel: int,
                    group: int) -> tuple[torch.Tensor, ...]:
    """What an owner's broadcast carries after its shard and counts: with parity, zero
    padding to a whole chunk and the XOR parity of every `group` chunks."""
    if not group:
        return ()
    numel = own.numel() + own_counts.numel()
    pad = torch.zeros(chunk_count(numel, chunk_numel) * chunk_numel - numel, dtype=own.dtype)
    rows = parity.xor_parity([bits(part) for part in (own, own_counts, pad) if part.numel()],
                             chunk_numel, group)
    return pad, torch.from_numpy(rows.reshape(-1)).view(own.dtype)
