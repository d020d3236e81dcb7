"""A Moshpit peer: it joins the run (membership, listener), runs a call's rounds (each a roll
call on the grid, then the all-reduce within the group that formed) within the call's
deadline, hands a joining peer its parameters, and leaves."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence

import torch

from testbed.collectives.base import CollectiveBase
from testbed.collectives.grid import Grid
from testbed.collectives.membership import Member, Membership
from testbed.collectives.moshpit.allreduce import average_in_group
from testbed.collectives.moshpit.channel import Channel
from testbed.collectives.moshpit.inbox import Inbox
from testbed.collectives.moshpit.matchmaking import roll_call
from testbed.collectives.moshpit.protocol import SEQ_BITS, Phase, encode_bucket
from testbed.collectives.moshpit.receiving import Receiver
from testbed.collectives.moshpit.schedule import Schedule
from testbed.collectives.moshpit.sending import Outbox
from testbed.collectives.moshpit.stats import MoshpitStats, RoundStats
from testbed.transport.staging import Staged
from testbed.transport.tcp import Listener, Message
from testbed.transport.tensors import codec_of, dtype_of
from testbed.transport.wire import Kind

log = logging.getLogger(__name__)


class Moshpit(CollectiveBase):
    """Worker `rank`'s end of Moshpit averaging among `world` peers (a `Collective`)."""

    name = "moshpit"

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        store: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        serve_store: bool | None = None,
        group_size: int = 4,
        timeout: float = 5.0,
        heartbeat: float = 1.0,
        expiry: float | None = None,
        run_id: int = 0,
        congestion: str | None = None,
        rendezvous_timeout: float = 60.0,
        key: bytes | None = None,
    ) -> None:
        """Join the run: listen on `listen` (a concrete address, as peers connect to it),
        register with the TCPStore at `store` (served here if `serve_store`, by default on rank
        0) and wait up to `rendezvous_timeout` for every rank to have registered once.
        `timeout` bounds each call (it returns within `timeout` + MARGIN); `heartbeat` and
        `expiry` (default four heartbeats) decide when a silent peer counts as gone. With `key`
        (the run's), every connection between peers proves it (the membership's store does
        not)."""
        if listen[0] in ("0.0.0.0", "::", ""):
            raise ValueError(f"listen: peers connect to this address; give a concrete one, "
                             f"not {listen[0]!r}")
        self.rank, self.world, self.timeout, self.run_id = rank, world, timeout, run_id
        self.grid = Grid.for_world(world, group_size)
        self.incarnation = secrets.randbits(31)
        self._inbox = Inbox()
        self._incarnations: dict[int, int] = {}  # per peer, the incarnation last seen
        self._outbox = Outbox(rank, run_id, congestion, key)
        self._lock = threading.Lock()  # closed
        self._closed = False
        # What `pull_state` hands a joining peer: the last result, or during a call its input.
        self._state: torch.Tensor | None = None
        self._step: int | None = None
        self._seq = 0
        self._listener = Listener(listen, congestion=congestion, key=key)
        try:
            self.membership = Membership(
                rank, world, store, run_id=run_id,
                serve=rank == 0 if serve_store is None else serve_store,
                heartbeat=heartbeat, expiry=expiry, timeout=rendezvous_timeout)
        except BaseException:
            self._listener.close()
            raise
        self._receiver = Receiver(rank, run_id, self._listener, self._inbox, self._answer_state)
        self.membership.register(Member(rank, self.incarnation, self._listener.address))
        absent = self.membership.wait_registered(range(world), rendezvous_timeout)
        if absent:
            log.warning("rank %d: ranks %s did not register within %g s; going on without them",
                        rank, sorted(absent), rendezvous_timeout)

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, MoshpitStats]:
        """All d rounds: the exact mean when nobody fails."""
        return self._average(tensor, step, list(range(self.grid.dims)))

    def average_round(self, tensor: torch.Tensor, round_index: int,
                      step: int | None = None) -> tuple[torch.Tensor, MoshpitStats]:
        """One round, on axis `round_index` mod d, as Moshpit SGD does once per step. `step`
        (default: `round_index`) must grow from call to call, as in `allreduce`."""
        return self._average(tensor, round_index if step is None else step, [round_index])

    def pull_state(self, timeout: float | None = None) -> torch.Tensor | None:
        """The current parameters (flat) from the first live neighbour that has some, asking
        each for up to `timeout` (default: the call timeout); None if none has any yet. They
        become this peer's state, served to the next joiner in turn."""
        alive = self.membership.alive()
        neighbours = dict.fromkeys(
            peer for round_index in range(self.grid.dims)
            for peer in self.grid.group(self.rank, round_index)
            if peer != self.rank and peer in alive)
        request = Member(self.rank, self.incarnation, self.address).encode().encode()
        try:
            for peer in neighbours:
                nonce = secrets.randbits(32)
                self._inbox.await_state(nonce)
                deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
                self._outbox.send(alive[peer], Kind.CONTROL, nonce,
                                  encode_bucket(Phase.STATE, 0, 0), request, deadline)
                reply = self._inbox.take([peer], nonce, 0, Phase.STATE, deadline).get(peer)
                if reply is not None and reply.payload:
                    self._state = torch.frombuffer(reply.payload,
                                                   dtype=dtype_of(reply.header.codec))
                    return self._state
        finally:
            self._inbox.await_state(None)
        return None

    def close(self) -> None:
        """Leave the run: say so in the store, stop and join every thread, close every
        socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.stop()  # no new threads from now on
            self._receiver.stop()
        self._inbox.stop()  # readers waiting for a round's slot drop what they hold
        self.membership.close()
        self._receiver.close()
        self._outbox.close()

    def _average(self, tensor: torch.Tensor, step: int,
                 round_indices: Sequence[int]) -> tuple[torch.Tensor, MoshpitStats]:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this Moshpit peer is closed")
        codec_of(tensor.dtype)  # a dtype the wire cannot carry fails here, not in a peer
        if not 0 <= step < 1 << 32:
            raise ValueError(f"step: the wire carries 0..2**32-1, got {step}")
        start, (sent, received) = time.monotonic(), self._bytes()
        schedule = Schedule(start, self.timeout, len(round_indices))
        # While the call lasts, a joiner is served the caller's own parameters (its input),
        # so the last call's result need not outlive the caller's use of it.
        staged = Staged(tensor)
        self._state = staged.host
        work = self._state.clone()
        weight = ideal = 1.0 / self.world  # the share of the world's contributions in `work`
        rounds = []
        for position, round_index in enumerate(round_indices):
            stats, weight = self._round(work, step, round_index, weight, schedule, position)
            ideal *= len(stats.group)
            rounds.append(stats)
        self._state = work
        now_sent, now_received = self._bytes()
        missing = sorted(set().union(*(r.missing for r in rounds)))
        return staged.back(work), MoshpitStats(
            collective=self.name, step=step, seconds=time.monotonic() - start,
            bytes_sent=now_sent - sent, bytes_received=now_received - received,
            coverage=min(1.0, weight / ideal), peers_missing=tuple(missing),
            extra={"rounds": float(len(rounds)),
                   "rounds_incomplete": float(sum(1 for r in rounds if r.missing))},
            rounds=tuple(rounds))

    def _round(self, work: torch.Tensor, step: int, round_index: int, weight: float,
               schedule: Schedule, position: int) -> tuple[RoundStats, float]:
        """Average `work` in place within this round's group, each phase within its share of
        the call (`schedule`; this is the call's `position`-th round); the round's stats and
        the new share of the world's contributions in `work`."""
        if self._step != step:
            self._step, self._seq = step, 0
        seq = self._seq % (1 << SEQ_BITS)
        self._seq += 1
        self._inbox.enter(step, seq)
        start, (sent, received) = time.monotonic(), self._bytes()
        grid_group = self.grid.group(self.rank, round_index)
        alive = self.membership.alive()
        for peer, member in alive.items():
            if self._incarnations.setdefault(peer, member.incarnation) != member.incarnation:
                self._incarnations[peer] = member.incarnation
                self._inbox.restarted(peer)  # not the predecessor whose connection closed
        channel = Channel(self.rank, step, seq, alive, self._outbox, self._inbox, schedule.end)
        group = roll_call(channel, grid_group, weight, schedule.roll_call(position))
        called = time.monotonic()
        result = average_in_group(channel, group, work, weight, schedule, position)
        now_sent, now_received = self._bytes()
        stats = RoundStats(
            round_index=round_index, axis=round_index % self.grid.dims, group=tuple(grid_group),
            present=result.present, missing=tuple(p for p in grid_group if p not in result.present),
            seconds=time.monotonic() - start, roll_call_seconds=called - start,
            scatter_seconds=result.scatter_seconds, bytes_sent=now_sent - sent,
            bytes_received=now_received - received, coverage=result.coverage)
        return stats, result.weight

    def _bytes(self) -> tuple[int, int]:
        return self._outbox.bytes_sent(), self._receiver.bytes_received()

    def _answer_state(self, peer: int, request: Message) -> None:
        """Send our current parameters (nothing, if we have none yet) to the address in the
        request: our view of the membership may not know the requester's new one yet."""
        requester = Member.decode(peer, request.payload.decode(errors="replace"))
        if requester is not None:
            state = self._state
            self._outbox.send(requester, Kind.PARAMETER, request.header.step,
                              encode_bucket(Phase.STATE, 0, 0), b"" if state is None else state,
                              time.monotonic() + self.timeout)
