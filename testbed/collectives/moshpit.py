"""Moshpit All-Reduce (after Ryabinin et al., "Moshpit SGD"), over TCP with timeouts.

Peers sit on the virtual grid of `grid.py`; round r averages within the group that shares every
coordinate but axis r mod d, so with no failures d rounds give the exact global mean. Each
round has three phases, each bounded by `timeout`:

1. roll call: every member sends READY (its coverage and the members it believes alive) to the
   others; the round's members are those who answered and whom every answerer counts on, so
   all members normally agree on them (a digest of the list travels with every later message;
   a peer with another list is left out instead of being misread).
2. reduce-scatter: the vector is split into one slice per member; each member sends slice i to
   member i and averages its own slice over the contributions that came in time.
3. all-gather: each member sends its averaged slice to the others.

A peer that fails, leaves or stops answering is left out of its group's average, never waited
for beyond a phase's timeout. Membership, rendezvous and heartbeats go through
torch.distributed's TCPStore (`membership.py`); a restarted peer pulls the current parameters
from a live neighbour (`pull_state`). docs/moshpit.md has the details.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum

import torch

from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.grid import Grid
from testbed.collectives.membership import Member, Membership
from testbed.transport.errors import TransportError, TransportTimeout
from testbed.transport.tcp import Listener, Message, Stream
from testbed.transport.tensors import codec_of, dtype_of
from testbed.transport.wire import FRAME_SIZE, Kind

ACCEPT_WAIT = 60.0  # seconds per accept call; `close` wakes the loop by connecting to it
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


class _Inbox:
    """Messages from peers, filed by (sender, step, round, phase) until a round takes them.
    Messages of rounds older than the current one are dropped, so a late peer can neither fill
    memory nor be mistaken for a later round; answers to state requests are kept only while
    awaited."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[tuple[int, int, int, Phase], Message] = {}
        self._floor = (0, 0)
        self._awaiting: int | None = None  # the nonce of the state request in flight

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
            for key in [k for k in self._messages if k[3] is not Phase.STATE]:
                if key[1:3] < self._floor:
                    del self._messages[key]

    def await_state(self, nonce: int | None) -> None:
        with self._cond:
            self._awaiting = nonce
            for key in [k for k in self._messages if k[3] is Phase.STATE]:
                del self._messages[key]

    def take(self, senders: Iterable[int], step: int, seq: int, phase: Phase,
             deadline: float) -> dict[int, Message]:
        """The messages of (step, seq, phase) from `senders` that came by `deadline`."""
        wanted, got = set(senders), {}
        with self._cond:
            while True:
                for sender in list(wanted):
                    message = self._messages.pop((sender, step, seq, phase), None)
                    if message is not None:
                        got[sender] = message
                        wanted.discard(sender)
                remaining = deadline - time.monotonic()
                if not wanted or remaining <= 0:
                    return got
                self._cond.wait(remaining)


class _Link:
    """The connection to one peer and the one thread that sends on it: a Stream is not
    thread-safe, and a peer that stops reading must hold up only what is sent to it."""

    def __init__(self, rank: int, peer: int, run_id: int, congestion: str | None,
                 key: bytes | None) -> None:
        self.rank, self.peer, self.run_id, self.congestion = rank, peer, run_id, congestion
        self.key = key
        self.bytes_sent = 0  # written by the sender thread only
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"moshpit-{rank}-to-{peer}")
        self._stream: Stream | None = None
        self._target: Member | None = None

    def send(self, member: Member, kind: Kind, step: int, bucket: int,
             payload: torch.Tensor | bytes, deadline: float) -> Future[None]:
        return self._executor.submit(self._send, member, kind, step, bucket, payload, deadline)

    def _send(self, member: Member, kind: Kind, step: int, bucket: int,
              payload: torch.Tensor | bytes, deadline: float) -> None:
        if deadline - time.monotonic() <= 0:  # queued behind a slow send: skip, keep the stream
            raise TransportTimeout(f"rank {self.rank}: no time left to send to rank {self.peer}")
        try:
            if self._stream is None or self._target != member:  # new, or a restarted peer
                self._drop()
                self._stream = Stream.connect(
                    member.address, rank=self.rank, peer=self.peer, run_id=self.run_id,
                    timeout=deadline - time.monotonic(), congestion=self.congestion,
                    key=self.key)
                self._target = member
            remaining = max(deadline - time.monotonic(), 1e-3)
            if isinstance(payload, torch.Tensor):
                self._stream.send_tensor(payload, kind=kind, step=step, bucket=bucket,
                                         timeout=remaining)
                size = payload.numel() * payload.element_size()
            else:
                self._stream.send_message(kind, step, bucket, payload, timeout=remaining)
                size = len(payload)
        except TransportError:
            self._drop()  # a partly sent message breaks the framing: start over next time
            raise
        self.bytes_sent += FRAME_SIZE + size

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = self._target = None

    def close(self) -> None:
        """Wait for the send in progress (bounded by its deadline), drop the queued ones."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._drop()


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
        `timeout` bounds each phase of a round; `heartbeat` and `expiry` (default four
        heartbeats) decide when a silent peer counts as gone. With `key` (the run's), every
        connection between peers proves it (the membership's store does not)."""
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
        self._state: torch.Tensor | None = None  # what `pull_state` hands a joining peer
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
        return self._average(tensor, step, range(self.grid.dims))

    def average_round(self, tensor: torch.Tensor, round_index: int,
                      step: int | None = None) -> tuple[torch.Tensor, MoshpitStats]:
        """One round, on axis `round_index` mod d, as Moshpit SGD does once per step. `step`
        (default: `round_index`) must grow from call to call, as in `allreduce`."""
        return self._average(tensor, round_index if step is None else step, [round_index])

    def pull_state(self, timeout: float | None = None) -> torch.Tensor | None:
        """The current parameters (flat) from the first live neighbour that has some, asking
        each for up to `timeout` (default: the phase timeout); None if none has any yet. They
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
                 round_indices: Iterable[int]) -> tuple[torch.Tensor, MoshpitStats]:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this Moshpit peer is closed")
        codec_of(tensor.dtype)  # a dtype the wire cannot carry fails here, not in a peer
        if not 0 <= step < 1 << 32:
            raise ValueError(f"step: the wire carries 0..2**32-1, got {step}")
        start, (sent, received) = time.monotonic(), self._bytes()
        work = tensor.detach().reshape(-1).clone()
        weight = ideal = 1.0 / self.world  # the share of the world's contributions in `work`
        rounds = []
        for position, round_index in enumerate(round_indices):
            stats, weight = self._round(work, step, round_index, weight,
                                        start + position * self.timeout)
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
               roll_call_from: float) -> tuple[RoundStats, float]:
        """Average `work` in place within this round's group; the round's stats and the new
        share of the world's contributions in `work`. The roll call waits `timeout` past
        `roll_call_from` at least: a partner held up by roll calls of earlier rounds (one
        timeout each at most) is late, not gone."""
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
        ready = torch.tensor([weight, *counted_on], dtype=torch.float64).numpy().tobytes()
        deadline = max(time.monotonic(), roll_call_from) + self.timeout
        for peer in others:
            self._send(alive[peer], Kind.CONTROL, step, _bucket(Phase.READY, seq, 0), ready,
                       deadline)
        views = {self.rank: (weight, set(counted_on))}
        for peer, message in self._inbox.take(others, step, seq, Phase.READY, deadline).items():
            view = _view(message.payload)
            if view is not None and self.rank in view[1]:
                views[peer] = view
        members = sorted(set(views).intersection(*(view[1] for view in views.values())))
        digest = _digest(members)
        slices = work.tensor_split(len(members))
        index = {peer: i for i, peer in enumerate(members)}
        partners = [peer for peer in members if peer != self.rank]
        own = slices[index[self.rank]]

        # Reduce-scatter. Peers left out hear it at once from the digest of an empty message
        # (not waited for: it carries none of `work`, and its peer may well be dead).
        deadline = time.monotonic() + self.timeout
        bucket = _bucket(Phase.SCATTER, seq, digest)
        for peer in others:
            if peer not in index:
                self._send(alive[peer], Kind.GRADIENT, step, bucket, b"", deadline)
        sends = [self._send(alive[peer], Kind.GRADIENT, step, bucket, slices[index[peer]],
                            deadline) for peer in partners]
        got = self._inbox.take(partners, step, seq, Phase.SCATTER, deadline)
        answered = [peer for peer, message in got.items() if _fits(message, digest, own)]
        for peer in answered:
            own.add_(_values(got[peer].payload, own.dtype))
        own.div_(1 + len(answered))
        _wait(sends)  # they read slices that the all-gather overwrites

        # All-gather, from those who answered (the others are presumed gone).
        deadline = time.monotonic() + self.timeout
        bucket = _bucket(Phase.GATHER, seq, digest)
        sends = [self._send(alive[peer], Kind.PARAMETER, step, bucket, own, deadline)
                 for peer in partners]
        got = self._inbox.take(answered, step, seq, Phase.GATHER, deadline)
        gathered = [peer for peer, message in got.items()
                    if _fits(message, digest, slices[index[peer]])]
        for peer in gathered:
            slices[index[peer]].copy_(_values(got[peer].payload, own.dtype))
        _wait(sends)  # `work` is the caller's next

        # Slices averaged by a member hold what our own slice holds; the others only ours.
        pooled_numel = own.numel() + sum(slices[index[peer]].numel() for peer in gathered)
        averaged = pooled_numel / work.numel() if work.numel() else 1.0
        pooled = weight + sum(views[peer][0] for peer in answered)
        present = sorted({self.rank, *gathered})
        now_sent, now_received = self._bytes()
        stats = RoundStats(
            round_index=round_index, axis=round_index % self.grid.dims, group=tuple(group),
            present=tuple(present), missing=tuple(p for p in group if p not in present),
            seconds=time.monotonic() - start, bytes_sent=now_sent - sent,
            bytes_received=now_received - received,
            coverage=(averaged * (1 + len(answered)) + 1 - averaged) / len(group))
        return stats, averaged * pooled + (1 - averaged) * weight

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
        while True:
            try:
                message = stream.recv_message()
            except TransportError:  # closed, reset, or not speaking our protocol
                break
            with self._lock:
                self._bytes_received += FRAME_SIZE + len(message.payload)
            header = message.header
            if header.sender != stream.peer:
                continue  # a peer speaking for another: not to be trusted
            if _fields(header.bucket)[0] is Phase.STATE and header.kind == Kind.CONTROL:
                self._answer_state(stream.peer, message)
            else:
                self._inbox.put(stream.peer, message)
        stream.close()

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


def _fits(message: Message, digest: int, like: torch.Tensor) -> bool:
    """Whether a message was sent for the same members and holds a slice like `like`."""
    header = message.header
    return (_fields(header.bucket)[2] == digest and header.codec == codec_of(like.dtype)
            and len(message.payload) == like.numel() * like.element_size())


def _values(payload: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A payload's elements without a copy (frombuffer refuses an empty buffer)."""
    return torch.frombuffer(payload, dtype=dtype) if payload else torch.empty(0, dtype=dtype)


def _wait(futures: Iterable[Future[None] | None]) -> None:
    """Wait for sends (each bounded by its deadline); a failed one shows as a missing peer."""
    for future in futures:
        if future is not None:
            future.exception()


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
