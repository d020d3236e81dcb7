"""A framed TCP stream: one connection between two workers, messages of a FRAME_SIZE header
and `length` payload bytes, a time limit on every operation, and errors that say who, whom
and what. `Stream.connect` is the caller's side of the hello (`greeting` is the listener's)."""

from __future__ import annotations

import dataclasses
import errno
import math
import socket
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import numpy as np
import torch

from testbed.transport.auth import NONCE_SIZE, hello_proof
from testbed.transport.counters import UNKNOWN_PEER, StreamCounters, TcpInfo, tcp_info
from testbed.transport.errors import PeerClosed, ProtocolError, TransportError, TransportTimeout
from testbed.transport.tcp.sockets import congestion_of, stream_socket
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
MAX_MESSAGE = 1 << 32  # a length beyond this is a broken or foreign stream, not a tensor
HELLO = struct.Struct("!H")  # HELLO payload: the rank the caller meant to reach (+ its proof)


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
            sock = stream_socket(address, congestion)
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
            hello = HELLO.pack(peer)
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
        return congestion_of(self.sock)

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
