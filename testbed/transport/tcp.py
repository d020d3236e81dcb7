"""TCP streams for the reliable paths (ring all-reduce, Moshpit groups, control): framed
messages (a FRAME_SIZE header, then `length` payload bytes), connected point to point or as a
mesh, with a deadline on every operation and errors that say who, whom and what.

Every socket has TCP_NODELAY (a collective's messages are latency-bound) and can choose its
congestion control (TCP_CONGESTION): cubic and bbr react to loss an order of magnitude apart,
so a scenario names one and the run records it (`Stream.congestion`). Retransmits of the
process's own connections come from TCP_INFO (`Stream.tcp_info().total_retrans`).

A connection starts with the caller's hello: whom it meant to reach, and, where the run has a
key, proof of it: the listener sends a fresh nonce on accepting, and the caller answers with a
MAC of it (`auth.hello_proof`), which a passive observer cannot replay on another connection.
The listener reads every caller's hello as its bytes come, side by side, so a caller that sends
half a hello (or nothing) holds up no other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import math
import os
import select
import socket
import struct
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, NoReturn

import numpy as np
import torch

from testbed.transport.auth import MAC_SIZE, NONCE_SIZE, hello_proof
from testbed.transport.counters import UNKNOWN_PEER, StreamCounters, TcpInfo, tcp_info
from testbed.transport.errors import PeerClosed, ProtocolError, TransportError, TransportTimeout
from testbed.transport.tensors import as_bytes, dtype_of
from testbed.transport.wire import (
    FRAME_SIZE,
    ITEMSIZE,
    MAGIC,
    VERSION,
    Codec,
    FrameHeader,
    Kind,
    MalformedDatagram,
    decode_frame,
    encode_frame,
)

CONNECT_RETRY = 0.05  # seconds between attempts while a peer's listener is not up yet
# A connect that fails with these is tried again: the peer's neighbour lookup can fail on a
# lossy link (its ARP packets are shaped too), which says nothing about the peer.
RETRIED = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})
# A caller says hello at once, but on a lossy link its segment may need retransmits: after a
# lost SYN, TCP's first retransmit comes 3 s later, the next 6 s after that.
HELLO_TIMEOUT = 30.0
# Connections a listener keeps waiting for their hellos; past this the oldest is closed, so a
# flood of connections that never speak cannot take every file descriptor.
MAX_GREETINGS = 256
MAX_MESSAGE = 1 << 32  # a length beyond this is a broken or foreign stream, not a tensor
_HELLO = struct.Struct("!H")  # HELLO payload: the rank the caller meant to reach (+ its proof)
_SYSCTL = Path("/proc/sys/net/ipv4")

Buffer = bytes | bytearray | memoryview


@dataclass
class Message:
    """A received message: its header and its payload bytes."""

    header: FrameHeader
    payload: bytearray


class Stream:
    """One TCP connection between this worker (`rank`) and `peer`. Not thread-safe; one
    thread may send while another receives."""

    def __init__(
        self,
        sock: socket.socket,
        address: tuple[str, int],
        *,
        rank: int,
        peer: int,
        run_id: int,
    ) -> None:
        self.sock, self.address = sock, address
        self.rank, self.peer, self.run_id = rank, peer, run_id
        self._counters = StreamCounters()

    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        *,
        rank: int,
        peer: int,
        run_id: int,
        timeout: float,
        congestion: str | None = None,
        key: bytes | None = None,
    ) -> Stream:
        """Connect to `peer`'s listener and say hello (with `key`, the run's, answering the
        listener's challenge with proof of it). Retries while the listener refuses (it may not
        be up yet) or the host is unreachable (on a lossy link the neighbour lookup's ARP
        packets are lost too: three lost in a row end a connect with EHOSTUNREACH)."""
        deadline = time.monotonic() + timeout
        where = f"rank {rank}: connecting to rank {peer} at {address[0]}:{address[1]}"
        while True:
            sock = _tcp_socket(address, congestion)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sock.connect(address)
                break
            except TimeoutError:
                sock.close()
                raise TransportTimeout(f"{where}: no answer within {timeout:g} s") from None
            except OSError as exc:
                sock.close()
                if not isinstance(exc, ConnectionRefusedError) and exc.errno not in RETRIED:
                    raise TransportError(f"{where}: {exc.strerror}") from None
                if time.monotonic() + CONNECT_RETRY > deadline:
                    raise TransportTimeout(
                        f"{where}: {exc.strerror} for {timeout:g} s; is its listener up?"
                    ) from None
                time.sleep(CONNECT_RETRY)  # nothing to wait on: the peer is not there yet
        stream = cls(sock, address, rank=rank, peer=peer, run_id=run_id)
        try:
            hello = _HELLO.pack(peer)
            if key is not None:
                hello += stream._prove(key, max(deadline - time.monotonic(), 1e-3))
            stream.send_message(Kind.HELLO, 0, 0, hello,
                                timeout=max(deadline - time.monotonic(), 1e-3))
        except BaseException:
            stream.close()
            raise
        return stream

    def _prove(self, key: bytes, timeout: float) -> bytes:
        """Read the listener's nonce; the proof of `key` that answers it."""
        nonce = bytearray(NONCE_SIZE)
        try:
            self._recv_into(memoryview(nonce), _Limit.of(timeout), "the listener's challenge")
        except TransportTimeout as exc:
            raise TransportTimeout(f"{exc}; does that listener have the run's key?") from None
        self._counters.bytes_received += NONCE_SIZE
        return hello_proof(key, bytes(nonce), self.run_id, self.rank, self.peer)

    @property
    def congestion(self) -> str:
        """The congestion control this connection really uses."""
        return _congestion(self.sock)

    def send_message(
        self,
        kind: Kind,
        step: int,
        bucket: int,
        payload: Buffer = b"",
        *,
        codec: Codec = Codec.BYTES,
        timeout: float | None = None,
    ) -> None:
        header = FrameHeader(MAGIC, VERSION, kind, codec, self.rank, self.run_id, step, bucket,
                             len(payload))
        self._send([memoryview(encode_frame(header)), memoryview(payload)], _Limit.of(timeout),
                   f"{Kind(kind).name} step {step} bucket {bucket}")
        self._counters.messages_sent += 1
        self._counters.bytes_sent += FRAME_SIZE + len(payload)

    def send_tensor(
        self,
        tensor: torch.Tensor | np.ndarray,
        *,
        kind: Kind,
        step: int,
        bucket: int,
        timeout: float | None = None,
    ) -> None:
        """Send a tensor's bytes (no copy for a contiguous CPU tensor)."""
        codec, data = as_bytes(tensor)
        self.send_message(kind, step, bucket, data, codec=codec, timeout=timeout)

    def recv_message(self, *, timeout: float | None = None) -> Message:
        limit = _Limit.of(timeout)
        header = self._recv_header(limit)
        payload = bytearray(header.length)
        self._recv_into(memoryview(payload), limit, "a message's payload")
        self._counted(header)
        return Message(header, payload)

    def recv_header(self, *, timeout: float | None = None) -> FrameHeader:
        """The next message's header alone: its `length` payload bytes must be read next
        (`recv_payload`), in as many pieces as the caller likes, so a large payload can land
        where it belongs piece by piece instead of in one buffer of its own."""
        header = self._recv_header(_Limit.of(timeout))
        self._counters.messages_received += 1
        self._counters.bytes_received += FRAME_SIZE
        return header

    def recv_payload(self, view: memoryview, *, timeout: float | None = None) -> None:
        """The next `len(view)` bytes of the payload whose header `recv_header` returned."""
        self._recv_into(view, _Limit.of(timeout), "a message's payload")
        self._counters.bytes_received += len(view)

    def recv_tensor(
        self,
        *,
        kind: Kind,
        step: int,
        bucket: int,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The next message, which must be (kind, step, bucket), as a flat tensor, received
        straight into `out` if given (same dtype and size; a mismatch is a ProtocolError)."""
        limit = _Limit.of(timeout)
        header = self._recv_header(limit)
        if (header.kind, header.step, header.bucket) != (kind, step, bucket):
            self._fail(f"expected {Kind(kind).name} step {step} bucket {bucket}, got "
                       f"{Kind(header.kind).name} step {header.step} bucket {header.bucket}")
        dtype = dtype_of(header.codec)
        numel = header.length // ITEMSIZE[header.codec]
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        elif out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
            self._fail(f"{numel} elements of {dtype} came for step {step} bucket {bucket}, "
                       f"expected {out.numel()} of {out.dtype} (contiguous)")
        self._recv_into(as_bytes(out)[1], limit, f"step {step} bucket {bucket}")
        self._counted(header)
        return out

    def tcp_info(self) -> TcpInfo:
        return tcp_info(self.sock)

    def counters(self) -> StreamCounters:
        """A snapshot; tcp_retransmits as of now (or of `close`)."""
        if self.sock.fileno() >= 0:
            self._counters.tcp_retransmits = self.tcp_info().total_retrans
        return dataclasses.replace(self._counters)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.counters()
            self.sock.close()

    # -- internals --------------------------------------------------------------------------

    def _where(self, action: str) -> str:
        peer = "an unidentified peer" if self.peer == UNKNOWN_PEER else f"rank {self.peer}"
        return f"rank {self.rank}: {action} {peer} at {self.address[0]}:{self.address[1]}"

    def _fail(self, problem: str) -> NoReturn:
        self.close()
        raise ProtocolError(f"{self._where('stream from')}: {problem}; stream closed")

    def _counted(self, header: FrameHeader) -> None:
        self._counters.messages_received += 1
        self._counters.bytes_received += FRAME_SIZE + header.length

    def _recv_header(self, limit: _Limit) -> FrameHeader:
        raw = bytearray(FRAME_SIZE)
        self._recv_into(memoryview(raw), limit, "a message header")
        try:
            header = decode_frame(raw, self.run_id)
        except MalformedDatagram as exc:
            self._fail(f"not a message of this run ({exc})")
        if header.length > MAX_MESSAGE:
            self._fail(f"a message of {header.length} bytes is announced")
        return header

    def _send(self, buffers: list[memoryview], limit: _Limit, what: str) -> None:
        total, sent = sum(map(len, buffers)), 0
        try:
            while buffers:
                self.sock.settimeout(limit.remaining())
                count = self.sock.sendmsg(buffers)
                sent += count
                buffers = _advance(buffers, count)
        except TimeoutError:
            raise TransportTimeout(
                f"{self._where(f'sending {what} to')}: {limit} passed after {sent} of {total} "
                "bytes"
            ) from None
        except OSError as exc:
            raise self._broken(exc, f"sending {what} to", sent, total) from None

    def _recv_into(self, view: memoryview, limit: _Limit, what: str) -> None:
        got = 0
        try:
            while got < len(view):
                self.sock.settimeout(limit.remaining())
                count = self.sock.recv_into(view[got:])
                if count == 0:
                    raise PeerClosed(f"{self._where(f'receiving {what} from')}: the peer closed "
                                     f"the connection after {got} of {len(view)} bytes")
                got += count
        except TimeoutError:
            raise TransportTimeout(
                f"{self._where(f'receiving {what} from')}: {limit} passed after {got} of "
                f"{len(view)} bytes"
            ) from None
        except PeerClosed:
            raise
        except OSError as exc:
            raise self._broken(exc, f"receiving {what} from", got, len(view)) from None

    def _broken(self, exc: OSError, action: str, done: int, total: int) -> TransportError:
        kind = PeerClosed if isinstance(exc, ConnectionError) else TransportError
        return kind(f"{self._where(action)}: {exc.strerror} after {done} of {total} bytes")


class _TurnedAway(Exception):
    """A caller whose hello is not one for this listener: what was wrong."""


class _Greeting:
    """A connection accepted whose hello is still coming. Its bytes are read as they come,
    without waiting (`read`), and it is heard once whole (`hear`)."""

    def __init__(self, stream: Stream, nonce: bytes) -> None:
        self.stream, self.nonce = stream, nonce  # the stream's address is the caller's
        self.since = time.monotonic()
        self.buffer = bytearray()
        self.header: FrameHeader | None = None

    @property
    def caller(self) -> str:
        return f"{self.stream.address[0]}:{self.stream.address[1]}"

    def read(self) -> bool:
        """Take in what has come of the hello; True once all of it is here. Raises
        `_TurnedAway` for a caller that closed, or whose header is no hello of this run."""
        wanted = FRAME_SIZE + (0 if self.header is None else self.header.length)
        try:
            data = self.stream.sock.recv(wanted - len(self.buffer))
        except BlockingIOError:
            return False
        except OSError as exc:
            problem = f"{exc.strerror} after {len(self.buffer)} bytes of its hello"
            raise _TurnedAway(problem) from None
        if not data:
            raise _TurnedAway(f"closed the connection after {len(self.buffer)} of {wanted} "
                              "bytes of its hello")
        self.buffer += data
        if self.header is None and len(self.buffer) == FRAME_SIZE:
            try:
                header = decode_frame(bytes(self.buffer), self.stream.run_id)
            except MalformedDatagram as exc:
                raise _TurnedAway(f"not a message of this run ({exc})") from None
            if header.kind != Kind.HELLO:
                raise _TurnedAway(f"{Kind(header.kind).name} instead of a hello")
            if header.length > _HELLO.size + MAC_SIZE:
                raise _TurnedAway(f"a hello of {header.length} bytes")
            self.header = header
        return self.header is not None and len(self.buffer) == FRAME_SIZE + self.header.length

    def hear(self, rank: int, expect: Collection[int] | None, key: bytes | None) -> None:
        """Check the whole hello: it proves `key` (if the run has one), it is for `rank`, from
        a peer in `expect`; the stream then names that peer. Raises `_TurnedAway`."""
        assert self.header is not None
        payload, sender = bytes(self.buffer[FRAME_SIZE:]), self.header.sender
        target = _HELLO.unpack_from(payload)[0] if len(payload) >= _HELLO.size else None
        proof = payload[_HELLO.size:]
        if target is None or len(proof) not in (0, MAC_SIZE):
            raise _TurnedAway(f"a hello of {len(payload)} payload bytes")
        if key is None and proof:
            raise _TurnedAway(f"rank {sender} proves a key; this listener has none")
        if key is not None and not proof:
            raise _TurnedAway(f"rank {sender} has no key; this run's listener wants proof of one")
        if key is not None and not hmac.compare_digest(
                proof, hello_proof(key, self.nonce, self.header.run_id, sender, target)):
            raise _TurnedAway(f"rank {sender}'s hello does not prove the run's key")
        if target != rank:
            raise _TurnedAway(f"rank {sender} meant to reach rank {target}")
        if expect is not None and sender not in expect:
            raise _TurnedAway(f"rank {sender}, not one of {sorted(expect)}")
        self.stream.peer = sender
        self.stream._counted(self.header)


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
        self._sock = _tcp_socket(address, congestion)
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
        self._greeting: list[_Greeting] = []  # connected, hello not yet whole

    @property
    def congestion(self) -> str:
        return _congestion(self._sock)

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
                except _TurnedAway as problem:
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
        greeting = _Greeting(stream, os.urandom(NONCE_SIZE) if self.key is not None else b"")
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


class StreamMesh:
    """Streams from `rank` to each of its peers: it connects to lower ranks and accepts higher
    ones, so any start order works as long as every listener is bound before the addresses
    are handed out. Outgoing connections use the listener's congestion control and key."""

    def __init__(self, rank: int, streams: dict[int, Stream]) -> None:
        self.rank, self.streams = rank, streams

    @classmethod
    def open(
        cls,
        rank: int,
        listener: Listener,
        addresses: Mapping[int, tuple[str, int]],
        *,
        run_id: int,
        peers: Collection[int] | None = None,
        timeout: float = 30.0,
    ) -> StreamMesh:
        """Connect to `peers` (default: every rank in `addresses` but this one)."""
        peers = set(addresses) - {rank} if peers is None else set(peers) - {rank}
        deadline = time.monotonic() + timeout
        congestion = listener.congestion
        streams: dict[int, Stream] = {}
        try:
            for peer in sorted(p for p in peers if p < rank):
                streams[peer] = Stream.connect(
                    addresses[peer], rank=rank, peer=peer, run_id=run_id,
                    timeout=deadline - time.monotonic(), congestion=congestion,
                    key=listener.key,
                )
            waiting = {p for p in peers if p > rank}
            while waiting:
                stream = listener.accept(rank=rank, run_id=run_id, expect=waiting,
                                         timeout=deadline - time.monotonic())
                waiting.discard(stream.peer)
                streams[stream.peer] = stream
        except BaseException:
            for stream in streams.values():
                stream.close()
            raise
        return cls(rank, streams)

    def __getitem__(self, peer: int) -> Stream:
        return self.streams[peer]

    def counters(self) -> dict[int, StreamCounters]:
        return {peer: stream.counters() for peer, stream in sorted(self.streams.items())}

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()

    def __enter__(self) -> StreamMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tcp_socket(address: tuple[str, int], congestion: str | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        except OSError as exc:
            sock.close()
            raise _congestion_error(congestion, exc) from None
    return sock


def _congestion_error(name: str, exc: OSError) -> TransportError:
    if isinstance(exc, PermissionError):
        allowed = (_SYSCTL / "tcp_allowed_congestion_control").read_text().split()
        return TransportError(f"congestion: {name!r} needs CAP_NET_ADMIN here; without it only "
                              f"{allowed} (net.ipv4.tcp_allowed_congestion_control)")
    available = (_SYSCTL / "tcp_available_congestion_control").read_text().split()
    return TransportError(f"congestion: {name!r} is not available ({exc.strerror}); this kernel "
                          f"has {available}")


def _congestion(sock: socket.socket) -> str:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()


class _Limit(NamedTuple):
    """The time limit of one message (`seconds` None: none), shared by its socket calls."""

    deadline: float
    seconds: float | None

    @classmethod
    def of(cls, seconds: float | None) -> _Limit:
        return cls(math.inf if seconds is None else time.monotonic() + seconds, seconds)

    def remaining(self) -> float | None:
        """Seconds left for the next socket call; raises TimeoutError when none are."""
        if self.seconds is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    def __str__(self) -> str:
        return f"the time limit of {self.seconds:g} s"


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """The buffers still to send after `count` bytes went."""
    while buffers and count >= len(buffers[0]):
        count -= len(buffers.pop(0))
    if buffers and count:
        buffers[0] = buffers[0][count:]
    return buffers
