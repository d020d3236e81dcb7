"""Moshpit's sending side: per peer a connection and the one thread that sends on it, made on
its first send; what a phase still sends at its end is abandoned (`Outbox`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from testbed.collectives.membership import Member
from testbed.transport.errors import TransportError, TransportTimeout
from testbed.transport.tcp import Stream
from testbed.transport.wire import FRAME_SIZE, Kind


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
            shutdown(writing)

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


class Outbox:
    """This peer's links, one per peer it sends to, each made on its first send; none once
    stopped (no new threads then)."""

    def __init__(self, rank: int, run_id: int, congestion: str | None,
                 key: bytes | None) -> None:
        self.rank, self.run_id, self.congestion, self.key = rank, run_id, congestion, key
        self._lock = threading.Lock()  # the links, stopped
        self._links: dict[int, _Link] = {}
        self._stopped = False

    def send(self, member: Member, kind: Kind, step: int, bucket: int,
             payload: torch.Tensor | bytes, deadline: float) -> Future[None] | None:
        """Queue a send to `member` (None once stopped)."""
        with self._lock:
            if self._stopped:
                return None
            link = self._links.get(member.rank)
            if link is None:
                link = self._links[member.rank] = _Link(self.rank, member.rank, self.run_id,
                                                        self.congestion, self.key)
        return link.send(member, kind, step, bucket, payload, deadline)

    def finish(self, sends: Mapping[int, Future[None] | None], until: float) -> None:
        """Wait for a phase's sends until its end; abandon those still going then."""
        going = [future for future in sends.values() if future is not None]
        wait(going, timeout=max(0.0, until - time.monotonic()))
        for peer, future in sends.items():
            if future is not None and not future.done():
                self._links[peer].abandon()

    def bytes_sent(self) -> int:
        with self._lock:
            return sum(link.bytes_sent for link in self._links.values())

    def stop(self) -> None:
        """No new sends from now on."""
        with self._lock:
            self._stopped = True

    def close(self) -> None:
        """Give up every link's sends and wait for its thread."""
        for link in self._links.values():
            link.close()


def shutdown(stream: Stream) -> None:
    """Wake the thread blocked on `stream` (closing alone would not)."""
    with contextlib.suppress(OSError):  # already closed
        stream.sock.shutdown(socket.SHUT_RDWR)
