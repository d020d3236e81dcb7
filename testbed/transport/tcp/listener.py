"""A listening socket that accepts connections and hears every caller's hello side by side,
so a caller that sends half a hello (or nothing) holds up no other."""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import time
from collections.abc import Collection

from testbed.transport.auth import NONCE_SIZE
from testbed.transport.counters import UNKNOWN_PEER
from testbed.transport.errors import TransportError, TransportTimeout
from testbed.transport.tcp.greeting import Greeting, TurnedAway
from testbed.transport.tcp.sockets import congestion_of, stream_socket
from testbed.transport.tcp.stream import Stream

# A caller says hello at once, but on a lossy link its segment may need retransmits: after a
# lost SYN, TCP's first retransmit comes 3 s later, the next 6 s after that.
HELLO_TIMEOUT = 30.0
# Connections a listener keeps waiting for their hellos; past this the oldest is closed, so a
# flood of connections that never speak cannot take every file descriptor.
MAX_GREETINGS = 256


class Listener:
    """A listening socket; connections accepted from it inherit its congestion control. With
    `key` (the run's), every caller must prove it in its hello."""

    def __init__(
        self,
        address: tuple[str, int] = ("0.0.0.0", 0),
        *,
        congestion: str | None = None,
        backlog: int = 128,
        key: bytes | None = None,
    ) -> None:
        self._sock = stream_socket(address, congestion)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(address)
            self._sock.listen(backlog)
        except OSError as exc:
            self._sock.close()
            where = f"listening on {address[0]}:{address[1]}"
            raise TransportError(f"{where}: {exc.strerror}") from None
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.key = key
        self._sock.setblocking(False)  # accepted only when select says a call is there
        self._greeting: list[Greeting] = []  # connected, hello not yet whole

    @property
    def congestion(self) -> str:
        return congestion_of(self._sock)

    def accept(
        self,
        *,
        rank: int,
        run_id: int,
        timeout: float,
        expect: Collection[int] | None = None,
    ) -> Stream:
        """The next peer (one of `expect`, if given) that says hello to `rank` in this run
        (proving the listener's key, if it has one). Every caller's hello is read as its bytes
        come, side by side, so one that is slow, silent or sends half a hello holds up nobody
        (on a lossy link a hello can need several retransmits, seconds apart); callers whose
        hello is not whole yet wait on the listener for the next call, for up to
        HELLO_TIMEOUT. Connections that say something else are closed and named in the
        timeout's message."""
        deadline = time.monotonic() + timeout
        turned_away: list[str] = []
        while (remaining := deadline - time.monotonic()) > 0:
            self._drop_silent(turned_away)
            waiting = [self._sock, *(greeting.stream.sock for greeting in self._greeting)]
            oldest = min((g.since for g in self._greeting), default=math.inf)
            wake = min(remaining, oldest + HELLO_TIMEOUT - time.monotonic())
            readable, _, _ = select.select(waiting, [], [], max(wake, 0.0))
            for sock in readable:
                if sock is self._sock:
                    self._take_call(rank, run_id, turned_away)
                    continue
                greeting = next(g for g in self._greeting if g.stream.sock is sock)
                try:
                    if not greeting.read():
                        continue
                    self._greeting.remove(greeting)
                    greeting.hear(rank, expect, self.key)
                except TurnedAway as problem:
                    if greeting in self._greeting:
                        self._greeting.remove(greeting)
                    greeting.stream.close()
                    turned_away.append(f"{greeting.caller}: {problem}")
                    continue
                return greeting.stream
        waited_for = f"ranks {sorted(expect)}" if expect is not None else "a peer"
        silent = [f"{g.caller} ({len(g.buffer)} bytes of its hello)" for g in self._greeting]
        extra = f"; turned away: {'; '.join(turned_away)}" if turned_away else ""
        extra += f"; connected, no whole hello yet: {', '.join(silent)}" if silent else ""
        raise TransportTimeout(
            f"rank {rank}: waiting on {self.address[0]}:{self.address[1]} for {waited_for} to "
            f"connect: timed out after {timeout:g} s{extra}"
        )

    def _take_call(self, rank: int, run_id: int, turned_away: list[str]) -> None:
        """Accept a connection; with a key, challenge it with a fresh nonce at once."""
        try:
            sock, source = self._sock.accept()
        except BlockingIOError:  # the caller gave up between select and accept
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)  # its hello is read as it comes
        stream = Stream(sock, source[:2], rank=rank, peer=UNKNOWN_PEER, run_id=run_id)
        greeting = Greeting(stream, os.urandom(NONCE_SIZE) if self.key is not None else b"")
        if greeting.nonce:
            try:  # 16 bytes into a new connection's empty send buffer: taken whole
                sent = sock.send(greeting.nonce)
            except OSError as exc:
                sent, problem = 0, exc.strerror
            else:
                problem = f"took {sent} of the challenge's {NONCE_SIZE} bytes"
            if sent != NONCE_SIZE:
                stream.close()
                turned_away.append(f"{greeting.caller}: {problem}")
                return
            stream._counters.bytes_sent += NONCE_SIZE
        self._greeting.append(greeting)
        while len(self._greeting) > MAX_GREETINGS:
            dropped = self._greeting.pop(0)
            dropped.stream.close()
            turned_away.append(f"{dropped.caller}: closed unheard, {MAX_GREETINGS} newer "
                               "callers were waiting to say hello")

    def _drop_silent(self, turned_away: list[str]) -> None:
        """Close the connections whose hello did not come whole within HELLO_TIMEOUT."""
        now = time.monotonic()
        for greeting in [g for g in self._greeting if now - g.since >= HELLO_TIMEOUT]:
            self._greeting.remove(greeting)
            greeting.stream.close()
            turned_away.append(f"{greeting.caller}: no whole hello within {HELLO_TIMEOUT:g} s "
                               f"({len(greeting.buffer)} bytes came)")

    def shutdown(self) -> None:
        """Wake a thread blocked in `accept` (it fails with OSError). Unlike connecting to
        ourselves, this works from any network namespace."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for greeting in self._greeting:
            greeting.stream.close()
        self._greeting.clear()
        self._sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

