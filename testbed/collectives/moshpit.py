"""Moshpit All-Reduce (after Ryabinin et al., "Moshpit SGD"), over TCP within one deadline.

Peers sit on the virtual grid of `grid.py`; round r averages within the group that shares every
coordinate but axis r mod d, so with no failures d rounds give the exact global mean. Each
round has three phases:

1. roll call: every member sends READY (its coverage and the members it believes alive) to the
   others; the round's members are those who answered and whom every answerer counts on, so
   all members normally agree on them (a digest of the list travels with every later message;
   a peer with another list is left out instead of being misread).
2. reduce-scatter: the vector is split into one slice per member; each member sends slice i to
   member i and averages its own slice over the contributions that came in time.
3. all-gather: each member sends its averaged slice to the others.

A call ends by `timeout` after it began: its first roll call may wait up to half of that for
members that are behind, and the other half is one window per round for its data (and from
the second round on, half a window for its roll call); a send still going when its phase ends
is abandoned. A peer whose connection closed (it died, or gave up on this one) is waited for
only a short grace more. Payloads land where they belong as they are read, block by block
(added into this peer's own slice, or copied over a member's slice), so a call holds its
result and a block per connection, not a copy of what it receives.
Membership, rendezvous and heartbeats go through torch.distributed's TCPStore
(`membership.py`); a restarted peer pulls the current parameters from a live neighbour
(`pull_state`). docs/moshpit.md has the details.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import IntEnum

import torch

from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.estimate import divide_by_chunk
from testbed.collectives.grid import Grid
from testbed.collectives.membership import Member, Membership
from testbed.transport.errors import TransportError, TransportTimeout
from testbed.transport.tcp import Listener, Message, Stream
from testbed.transport.tensors import codec_of, dtype_of
from testbed.transport.wire import FRAME_SIZE, FrameHeader, Kind

ACCEPT_WAIT = 60.0  # seconds per accept call; `close` wakes the loop by connecting to it
# A payload is read and landed in blocks of this many bytes: all a connection's reader holds
# beyond where the payload belongs.
BLOCK_BYTES = 1 << 16
# Seconds a peer whose connection closed is still waited for: a live peer that abandoned a send
# reconnects at its next one; a dead one does not.
GRACE = 0.2
# A call returns within `timeout` + MARGIN: past its last wait it only abandons the sends still
# going and counts; the margin is for thread wake-ups on a loaded host.
MARGIN = 0.25
# The header's bucket: phase (2 bits) | round in the step | member digest (testbed.transport.wire).
_SEQ_BITS, _DIGEST_BITS = 10, 20
log = logging.getLogger(__name__)


class Phase(IntEnum):
    """What a message is for; it sits in the top two bits of the header's bucket."""

    READY = 0
    SCATTER = 1
    GATHER = 2
    STATE = 3  # CONTROL: a joining peer asks for parameters; PARAMETER: the answer


def _bucket(phase: Phase, seq: int, digest: int) -> int:
    return phase << (_SEQ_BITS + _DIGEST_BITS) | seq << _DIGEST_BITS | digest


def _fields(bucket: int) -> tuple[Phase, int, int]:
    """(phase, round in the step, members digest) of a bucket."""
    return (Phase(bucket >> (_SEQ_BITS + _DIGEST_BITS) & 3),
            bucket >> _DIGEST_BITS & ((1 << _SEQ_BITS) - 1), bucket & ((1 << _DIGEST_BITS) - 1))


def _digest(members: Sequence[int]) -> int:
    return zlib.crc32(",".join(map(str, members)).encode()) & ((1 << _DIGEST_BITS) - 1)


@dataclass(frozen=True)
class RoundStats:
    """One round as this peer saw it. `present`: members whose contribution made it into this
    peer's result in both phases; `coverage`: the fraction of (group member, element) pairs
    that did."""

    round_index: int
    axis: int
    group: tuple[int, ...]
    present: tuple[int, ...]
    missing: tuple[int, ...]
    seconds: float
    bytes_sent: int
    bytes_received: int
    coverage: float


@dataclass(repr=False)
class MoshpitStats(AllReduceStats):
    """AllReduceStats with the rounds. `coverage` is the fraction of the contributions that the
    same rounds reach with no failures (1.0: the exact mean after d rounds); it is exact when
    peers fail between rounds and estimated when one fails inside a round."""

    rounds: tuple[RoundStats, ...] = ()


class _Slot:
    """Where one member's slice of a round lands as it is read, block by block: added into this
    peer's own slice (reduce-scatter) or copied over the member's slice of the vector
    (all-gather). `counts` (reduce-scatter) gets one more contribution per block that landed;
    `landed` counts the elements. Only a payload of the round's members (its digest) and of the
    target's size and dtype fits."""

    def __init__(self, target: torch.Tensor, digest: int,
                 counts: torch.Tensor | None = None) -> None:
        self.target, self.digest, self.counts = target, digest, counts
        self.block = BLOCK_BYTES // target.element_size()  # elements per block
        self.landed = 0

    def fits(self, header: FrameHeader) -> bool:
        return (_fields(header.bucket)[2] == self.digest
                and header.codec == codec_of(self.target.dtype)
                and header.length == self.target.numel() * self.target.element_size())

    def land(self, offset: int, piece: memoryview) -> None:
        """A block of the payload, `offset` bytes into it (a multiple of BLOCK_BYTES)."""
        start = offset // self.target.element_size()
        values = torch.frombuffer(piece, dtype=self.target.dtype)
        part = self.target[start:start + values.numel()]
        if self.counts is None:
            part.copy_(values)
        else:
            part.add_(values)
            self.counts[start // self.block] += 1
        self.landed += values.numel()


Key = tuple[int, int, int, Phase]  # (sender, step, round in the step, phase)


class _Inbox:
    """What peers send, by (sender, step, round, phase): whole messages filed until a round
    takes them (READY, state, empty or refused payloads), and the slots a round opens for the
    payloads of its reduce-scatter and all-gather, which land as they are read. Messages of
    rounds older than the current one, and payloads of its phases that ended, are dropped, so a
    late peer can neither fill memory nor be mistaken for a later round; answers to state
    requests are kept only while awaited. A peer whose latest connection closed is waited for
    GRACE seconds more, not until a deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[Key, Message] = {}
        self._slots: dict[Key, _Slot] = {}
        self._filled: set[Key] = set()  # slots whose payload landed whole
        self._floor = (0, 0)
        self._ended: set[Phase] = set()  # phases of the floor's round that ended
        self._streams: dict[int, Stream] = {}  # per sender, its latest connection
        self._closed_at: dict[int, float] = {}  # per sender whose latest connection closed
        self._awaiting: int | None = None  # the nonce of the state request in flight
        self._stopped = False

    def put(self, sender: int, message: Message) -> None:
        phase, seq, _ = _fields(message.header.bucket)
        step = message.header.step
        with self._cond:
            late = (step != self._awaiting if phase is Phase.STATE else (step, seq) < self._floor)
            if not late:
                self._messages[(sender, step, seq, phase)] = message
                self._cond.notify_all()

    def enter(self, step: int, seq: int) -> None:
        """A new round starts: forget what is older."""
        with self._cond:
            self._floor = (step, seq)
            self._ended.clear()
            for key in [k for k in self._messages if k[3] is not Phase.STATE]:
                if key[1:3] < self._floor:
                    del self._messages[key]
            self._filled = {key for key in self._filled if key[1:3] >= self._floor}
            self._cond.notify_all()

    def await_state(self, nonce: int | None) -> None:
        with self._cond:
            self._awaiting = nonce
            for key in [k for k in self._messages if k[3] is Phase.STATE]:
                del self._messages[key]

    def connected(self, sender: int, stream: Stream) -> None:
        with self._cond:
            self._streams[sender] = stream
            self._closed_at.pop(sender, None)

    def disconnected(self, sender: int, stream: Stream) -> None:
        with self._cond:
            if self._streams.get(sender) is stream:
                self._closed_at[sender] = time.monotonic()
                self._cond.notify_all()

    def open(self, step: int, seq: int, phase: Phase, slots: Mapping[int, _Slot]) -> None:
        """Land the senders' payloads of (step, seq, phase) in their slots from now on."""
        with self._cond:
            for sender, slot in slots.items():
                self._slots[(sender, step, seq, phase)] = slot
            self._cond.notify_all()

    def end(self, step: int, seq: int, phase: Phase, senders: Iterable[int]) -> set[int]:
        """Close (step, seq, phase): nothing lands any more. The senders whose payload landed
        whole."""
        with self._cond:
            keys = {sender: (sender, step, seq, phase) for sender in senders}
            for key in keys.values():
                self._slots.pop(key, None)
            self._ended.add(phase)
            self._cond.notify_all()
            return {sender for sender, key in keys.items() if key in self._filled}

    def slot(self, sender: int, header: FrameHeader) -> _Slot | None:
        """Where a payload of (step, seq, phase) from `sender` goes, once its round opened it;
        None if it never will (a round or phase that is over, or this peer closing). Blocks
        meanwhile: the payload waits in the connection, not in memory."""
        phase, seq, _ = _fields(header.bucket)
        key = (sender, header.step, seq, phase)
        with self._cond:
            while True:
                slot = self._slots.get(key)
                if slot is not None:
                    return slot
                if self._stopped or (header.step, seq) < self._floor or (
                        (header.step, seq) == self._floor and phase in self._ended):
                    return None
                self._cond.wait()

    def land(self, key: Key, slot: _Slot, offset: int, piece: memoryview) -> bool:
        """Land a block in `slot` if its phase still lasts; False once it ended."""
        with self._cond:
            if self._slots.get(key) is not slot:
                return False
            slot.land(offset, piece)
            return True

    def fill(self, key: Key, slot: _Slot) -> None:
        """The whole payload landed in `slot` in time."""
        with self._cond:
            if self._slots.get(key) is slot:
                self._filled.add(key)
                self._cond.notify_all()

    def take(self, senders: Iterable[int], step: int, seq: int, phase: Phase,
             deadline: float) -> dict[int, Message]:
        """The filed messages of (step, seq, phase) from `senders` that came by `deadline`."""
        wanted, got = set(senders), {}

        def done(sender: int) -> bool:
            message = self._messages.pop((sender, step, seq, phase), None)
            if message is not None:
                got[sender] = message
            return message is not None

        self._await(wanted, deadline, done)
        return got

    def wait(self, senders: Iterable[int], step: int, seq: int, phase: Phase,
             deadline: float) -> None:
        """Until every sender's payload of (step, seq, phase) landed whole, or a message of
        it that does not fit came instead (an empty one: this peer was left out), or
        `deadline`."""
        self._await(set(senders), deadline, lambda sender: (
            (sender, step, seq, phase) in self._filled
            or (sender, step, seq, phase) in self._messages))

    def stop(self) -> None:
        """This peer closes: nothing is waited for any more."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _await(self, wanted: set[int], deadline: float, done: Callable[[int], bool]) -> None:
        """Wait on the condition until `done` holds for each of `wanted`, its sender's
        connection has been closed for GRACE seconds, or `deadline`."""
        with self._cond:
            while True:
                wanted = {sender for sender in wanted if not done(sender)}
                now = time.monotonic()
                limits = [min(deadline, self._closed_at.get(sender, math.inf) + GRACE)
                          for sender in wanted]
                until = max((limit for limit in limits if limit > now), default=None)
                if until is None or self._stopped:
                    return
                self._cond.wait(until - now)


class _Abandoned(TransportTimeout):
    """A send given up before it began: its stream is left as it was."""


class _Link:
    """The connection to one peer and the one thread that sends on it: a Stream is not
    thread-safe, and a peer that stops reading must hold up only what is sent to it. Sends
    are numbered as they are queued, so `abandon` can give up those queued so far."""

    def __init__(self, rank: int, peer: int, run_id: int, congestion: str | None,
                 key: bytes | None) -> None:
        self.rank, self.peer, self.run_id, self.congestion = rank, peer, run_id, congestion
        self.key = key
        self.bytes_sent = 0  # written by the sender thread only
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"moshpit-{rank}-to-{peer}")
        self._stream: Stream | None = None
        self._target: Member | None = None
        self._lock = threading.Lock()  # the numbers below, and the stream being written
        self._queued = 0
        self._abandoned = 0  # sends numbered below this are given up
        self._writing: Stream | None = None

    def send(self, member: Member, kind: Kind, step: int, bucket: int,
             payload: torch.Tensor | bytes, deadline: float) -> Future[None]:
        with self._lock:
            number, self._queued = self._queued, self._queued + 1
        return self._executor.submit(self._send, number, member, kind, step, bucket, payload,
                                     deadline)

    def abandon(self) -> None:
        """Give up every send queued so far: those not begun are skipped, one being written is
        cut (its stream is shut down: a partly sent message breaks the framing, and the peer
        learns at once that nothing more of it comes). Once this returns, no queued send reads
        its payload any more."""
        with self._lock:
            self._abandoned = self._queued
            writing = self._writing
        if writing is not None:
            _shutdown(writing)

    def _send(self, number: int, member: Member, kind: Kind, step: int, bucket: int,
              payload: torch.Tensor | bytes, deadline: float) -> None:
        try:
            if number < self._abandoned:
                raise _Abandoned(f"rank {self.rank}: gave up sending to rank {self.peer}")
            if deadline - time.monotonic() <= 0:  # queued behind a slow send: skip it
                raise _Abandoned(f"rank {self.rank}: no time left to send to rank {self.peer}")
            if self._stream is None or self._target != member:  # new, or a restarted peer
                self._drop()
                self._stream = Stream.connect(
                    member.address, rank=self.rank, peer=self.peer, run_id=self.run_id,
                    timeout=deadline - time.monotonic(), congestion=self.congestion,
                    key=self.key)
                self._target = member
            with self._lock:
                if number < self._abandoned:
                    raise _Abandoned(f"rank {self.rank}: gave up sending to rank {self.peer}")
                self._writing = self._stream
            try:
                remaining = max(deadline - time.monotonic(), 1e-3)
                if isinstance(payload, torch.Tensor):
                    self._stream.send_tensor(payload, kind=kind, step=step, bucket=bucket,
                                             timeout=remaining)
                    size = payload.numel() * payload.element_size()
                else:
                    self._stream.send_message(kind, step, bucket, payload, timeout=remaining)
                    size = len(payload)
            finally:
                with self._lock:
                    self._writing = None
        except _Abandoned:
            raise
        except TransportError:
            self._drop()  # a partly sent message breaks the framing: start over next time
            raise
        self.bytes_sent += FRAME_SIZE + size

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = self._target = None

    def close(self) -> None:
        """Give up what is queued and being sent, and wait for the thread."""
        self.abandon()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._drop()


class _Schedule:
    """How a call's time is shared out, on this peer's clock. The call ends by `end`
    (`start` + timeout). Its first roll call may wait for members up to half of it: peers that
    began the call later (they computed longer, or their previous call took longer) are waited
    for there, so they meet the others instead of running out of step with them. The second
    half is one window per round: round r's reduce-scatter and all-gather end by the end of its
    window, and from round 1 on its roll call waits up to half a window past the window's start
    (a member held up in the round before, waiting for a peer that failed, comes by then).
    The reduce-scatter may wait half of what is left of the window, the all-gather the rest."""

    def __init__(self, start: float, timeout: float, rounds: int) -> None:
        self.end = start + timeout
        self.half = start + timeout / 2
        self.window = timeout / 2 / max(1, rounds)

    def roll_call(self, position: int) -> float:
        """When the roll call of the call's `position`-th round stops waiting."""
        return self.half + (position + 0.5) * self.window if position else self.half

    def scatter(self, position: int) -> float:
        now = time.monotonic()
        return now + max(0.0, self.gather(position) - now) / 2

    def gather(self, position: int) -> float:
        return self.half + (position + 1) * self.window


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
        self._congestion, self._key = congestion, key
        self._inbox = _Inbox()
        self._lock = threading.Lock()  # links, readers, received bytes, closed
        self._links: dict[int, _Link] = {}
        self._readers: list[tuple[Stream, threading.Thread]] = []
        self._bytes_received = 0
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
        self._acceptor = threading.Thread(target=self._accept, name=f"moshpit-{rank}-accept",
                                          daemon=True)
        self._acceptor.start()
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
                self._send(alive[peer], Kind.CONTROL, nonce, _bucket(Phase.STATE, 0, 0),
                           request, deadline)
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
        self._inbox.stop()  # readers waiting for a round's slot drop what they hold
        self.membership.close()
        self._listener.shutdown()  # the accept loop returns on OSError
        self._acceptor.join()
        self._listener.close()
        for stream, _ in self._readers:
            _shutdown(stream)
        for _, thread in self._readers:
            thread.join()
        for link in self._links.values():
            link.close()

    # -- a round ----------------------------------------------------------------------------

    def _average(self, tensor: torch.Tensor, step: int,
                 round_indices: Sequence[int]) -> tuple[torch.Tensor, MoshpitStats]:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this Moshpit peer is closed")
        codec_of(tensor.dtype)  # a dtype the wire cannot carry fails here, not in a peer
        if not 0 <= step < 1 << 32:
            raise ValueError(f"step: the wire carries 0..2**32-1, got {step}")
        start, (sent, received) = time.monotonic(), self._bytes()
        schedule = _Schedule(start, self.timeout, len(round_indices))
        # While the call lasts, a joiner is served the caller's own parameters (its input),
        # so the last call's result need not outlive the caller's use of it.
        self._state = tensor.detach().reshape(-1)
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
        return work.view_as(tensor), MoshpitStats(
            collective=self.name, step=step, seconds=time.monotonic() - start,
            bytes_sent=now_sent - sent, bytes_received=now_received - received,
            coverage=min(1.0, weight / ideal), peers_missing=tuple(missing),
            extra={"rounds": float(len(rounds)),
                   "rounds_incomplete": float(sum(1 for r in rounds if r.missing))},
            rounds=tuple(rounds))

    def _round(self, work: torch.Tensor, step: int, round_index: int, weight: float,
               schedule: _Schedule, position: int) -> tuple[RoundStats, float]:
        """Average `work` in place within this round's group, each phase within its share of
        the call (`schedule`; this is the call's `position`-th round); the round's stats and
        the new share of the world's contributions in `work`."""
        if self._step != step:
            self._step, self._seq = step, 0
        seq = self._seq % (1 << _SEQ_BITS)
        self._seq += 1
        self._inbox.enter(step, seq)
        start, (sent, received) = time.monotonic(), self._bytes()
        group = self.grid.group(self.rank, round_index)
        alive = self.membership.alive()
        counted_on = [peer for peer in group if peer == self.rank or peer in alive]
        others = [peer for peer in counted_on if peer != self.rank]

        # Roll call: the members are those who answered and whom every answerer counts on.
        until = schedule.roll_call(position)
        ready = torch.tensor([weight, *counted_on], dtype=torch.float64).numpy().tobytes()
        sends = {peer: self._send(alive[peer], Kind.CONTROL, step,
                                  _bucket(Phase.READY, seq, 0), ready, schedule.end)
                 for peer in others}
        views = {self.rank: (weight, set(counted_on))}
        for peer, message in self._inbox.take(others, step, seq, Phase.READY, until).items():
            view = _view(message.payload)
            if view is not None and self.rank in view[1]:
                views[peer] = view
        self._finish(sends, until)
        members = sorted(set(views).intersection(*(view[1] for view in views.values())))
        digest = _digest(members)
        slices = work.tensor_split(len(members))
        index = {peer: i for i, peer in enumerate(members)}
        partners = [peer for peer in members if peer != self.rank]
        own = slices[index[self.rank]]

        # Reduce-scatter: the partners' slices are added into our own as they are read, with
        # the contributions counted per block (a partner cut off mid-way counts where its
        # blocks came). Peers left out hear it at once from the digest of an empty message
        # (not waited for: it carries none of `work`, and its peer may well be dead).
        until = schedule.scatter(position)
        block = BLOCK_BYTES // own.element_size()
        counts = torch.ones(max(1, -(-own.numel() // block)),
                            dtype=torch.float64)  # our own contribution is in every block
        scatter = {peer: _Slot(own, digest, counts) for peer in partners}
        self._inbox.open(step, seq, Phase.SCATTER, scatter)
        bucket = _bucket(Phase.SCATTER, seq, digest)
        for peer in others:
            if peer not in index:
                self._send(alive[peer], Kind.GRADIENT, step, bucket, b"", schedule.end)
        sends = {peer: self._send(alive[peer], Kind.GRADIENT, step, bucket, slices[index[peer]],
                                  schedule.end) for peer in partners}
        self._inbox.wait(partners, step, seq, Phase.SCATTER, until)
        answered = sorted(self._inbox.end(step, seq, Phase.SCATTER, partners))
        self._finish(sends, until)  # they read slices that the all-gather overwrites
        if own.numel():
            divide_by_chunk(own, counts, block, own)
        shares = {peer: scatter[peer].landed / max(1, own.numel()) for peer in partners}

        # All-gather, from those who answered (the others are presumed gone): each member's
        # averaged slice is copied over its slice of `work` as it is read.
        until = schedule.gather(position)
        gather = {peer: _Slot(slices[index[peer]], digest) for peer in answered}
        self._inbox.open(step, seq, Phase.GATHER, gather)
        bucket = _bucket(Phase.GATHER, seq, digest)
        sends = {peer: self._send(alive[peer], Kind.PARAMETER, step, bucket, own, schedule.end)
                 for peer in partners}
        self._inbox.wait(answered, step, seq, Phase.GATHER, until)
        gathered = self._inbox.end(step, seq, Phase.GATHER, answered)
        self._finish(sends, until)  # `work` is the caller's next

        # Slices averaged by a member hold what our own slice holds; the others only ours.
        pooled_numel = own.numel() + sum(slot.landed for slot in gather.values())
        averaged = pooled_numel / work.numel() if work.numel() else 1.0
        pooled = weight + sum(views[peer][0] * share for peer, share in shares.items())
        present = sorted({self.rank, *gathered})
        now_sent, now_received = self._bytes()
        stats = RoundStats(
            round_index=round_index, axis=round_index % self.grid.dims, group=tuple(group),
            present=tuple(present), missing=tuple(p for p in group if p not in present),
            seconds=time.monotonic() - start, bytes_sent=now_sent - sent,
            bytes_received=now_received - received,
            coverage=(averaged * (1 + sum(shares.values())) + 1 - averaged) / len(group))
        return stats, averaged * pooled + (1 - averaged) * weight

    def _finish(self, sends: Mapping[int, Future[None] | None], until: float) -> None:
        """Wait for a phase's sends until its end; abandon those still going then."""
        going = [future for future in sends.values() if future is not None]
        wait(going, timeout=max(0.0, until - time.monotonic()))
        for peer, future in sends.items():
            if future is not None and not future.done():
                self._links[peer].abandon()

    # -- plumbing ---------------------------------------------------------------------------

    def _send(self, member: Member, kind: Kind, step: int, bucket: int,
              payload: torch.Tensor | bytes, deadline: float) -> Future[None] | None:
        """Queue a send to `member` (None once closing: no new threads then)."""
        with self._lock:
            if self._closed:
                return None
            link = self._links.get(member.rank)
            if link is None:
                link = self._links[member.rank] = _Link(self.rank, member.rank, self.run_id,
                                                        self._congestion, self._key)
        return link.send(member, kind, step, bucket, payload, deadline)

    def _bytes(self) -> tuple[int, int]:
        with self._lock:
            return sum(link.bytes_sent for link in self._links.values()), self._bytes_received

    def _accept(self) -> None:
        """Accept peers' connections; each gets a thread that files what it receives."""
        while not self._closed:
            try:
                stream = self._listener.accept(rank=self.rank, run_id=self.run_id,
                                               timeout=ACCEPT_WAIT)
            except TransportTimeout as exc:  # nobody new for a while (it names any turned away)
                log.debug("%s", exc)
                continue
            except (TransportError, OSError):  # the listener was closed under us
                return
            with self._lock:
                if self._closed:
                    stream.close()
                    return
                thread = threading.Thread(target=self._receive, args=(stream,), daemon=True,
                                          name=f"moshpit-{self.rank}-from-{stream.peer}")
                self._readers = [(s, t) for s, t in self._readers if t.is_alive()]
                self._readers.append((stream, thread))
            thread.start()

    def _receive(self, stream: Stream) -> None:
        """File what a peer sends, until its connection closes: a round's payloads land where
        they belong, the rest is filed whole."""
        peer, block = stream.peer, bytearray()
        self._inbox.connected(peer, stream)
        try:
            while True:
                header = stream.recv_header()
                with self._lock:
                    self._bytes_received += FRAME_SIZE
                phase = _fields(header.bucket)[0]
                trusted = header.sender == peer  # a peer speaking for another is not
                if phase in (Phase.SCATTER, Phase.GATHER) and header.length:
                    block = block or bytearray(BLOCK_BYTES)
                    self._land(stream, header, trusted, memoryview(block))
                    continue
                payload = bytearray(header.length)
                stream.recv_payload(memoryview(payload))
                with self._lock:
                    self._bytes_received += header.length
                if not trusted:
                    continue
                if phase is Phase.STATE and header.kind == Kind.CONTROL:
                    self._answer_state(peer, Message(header, payload))
                else:
                    self._inbox.put(peer, Message(header, payload))
        except TransportError:  # closed, reset, or not speaking our protocol
            pass
        finally:
            self._inbox.disconnected(peer, stream)
            stream.close()

    def _land(self, stream: Stream, header: FrameHeader, trusted: bool,
              block: memoryview) -> None:
        """Read a round's payload block by block into its slot, once its round opened one
        (meanwhile it waits in the connection); one that has no slot, or does not fit it
        (another list of members), is read and dropped, and filed empty: not waited for."""
        phase, seq, _ = _fields(header.bucket)
        key = (stream.peer, header.step, seq, phase)
        slot = self._inbox.slot(stream.peer, header) if trusted else None
        refused = slot is not None and not slot.fits(header)
        if refused:
            slot = None
        for offset in range(0, header.length, BLOCK_BYTES):
            piece = block[:min(BLOCK_BYTES, header.length - offset)]
            stream.recv_payload(piece)
            with self._lock:
                self._bytes_received += len(piece)
            if slot is not None and not self._inbox.land(key, slot, offset, piece):
                slot = None  # its phase ended: the rest is read and dropped
        if slot is not None:
            self._inbox.fill(key, slot)
        elif refused:
            self._inbox.put(stream.peer, Message(header, bytearray()))

    def _answer_state(self, peer: int, request: Message) -> None:
        """Send our current parameters (nothing, if we have none yet) to the address in the
        request: our view of the membership may not know the requester's new one yet."""
        requester = Member.decode(peer, request.payload.decode(errors="replace"))
        if requester is not None:
            state = self._state
            self._send(requester, Kind.PARAMETER, request.header.step,
                       _bucket(Phase.STATE, 0, 0), b"" if state is None else state,
                       time.monotonic() + self.timeout)


def _view(payload: bytearray) -> tuple[float, set[int]] | None:
    """A READY message's (coverage, members counted on); None if malformed."""
    if len(payload) < 16 or len(payload) % 8:
        return None
    values = torch.frombuffer(payload, dtype=torch.float64)
    return float(values[0]), set(values[1:].long().tolist())


def _shutdown(stream: Stream) -> None:
    """Wake the thread blocked receiving on `stream` (closing alone would not)."""
    with contextlib.suppress(OSError):  # already closed
        stream.sock.shutdown(socket.SHUT_RDWR)


# -- a peer process: `python -m testbed.collectives.moshpit` --------------------------------


def demo_input(rank: int, step: int, numel: int) -> torch.Tensor:
    """The tensor a demo peer contributes at `step`: anyone can recompute it to check results."""
    generator = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return torch.randn(numel, generator=generator)


def run_demo_peer(rank: int, world: int, store: tuple[str, int], *, serve_store: bool = False,
                  listen: str = "127.0.0.1", group_size: int = 4, timeout: float = 5.0,
                  heartbeat: float = 1.0, steps: int = 10, numel: int = 100_000,
                  interval: float = 0.0) -> int:
    """`testbed moshpit-peer`: all-reduce `demo_input` for `steps` steps, one JSON line per
    step on stdout (missing peers, coverage, seconds, the result's head and sum)."""
    peer = Moshpit(rank, world, store=store, listen=(listen, 0), serve_store=serve_store,
                   group_size=group_size, timeout=timeout, heartbeat=heartbeat)
    try:
        for step in range(steps):
            result, stats = peer.allreduce(demo_input(rank, step, numel), step)
            print(json.dumps({
                "step": step, "missing": list(stats.peers_missing), "coverage": stats.coverage,
                "seconds": stats.seconds, "head": result[:4].tolist(),
                "sum": result.double().sum().item(),
            }), flush=True)
            time.sleep(interval)
    finally:
        peer.close()
    return 0
