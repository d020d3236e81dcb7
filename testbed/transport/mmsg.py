"""recvmmsg(2) and sendmmsg(2) through ctypes: many datagrams per system call.

One Python call per datagram cost more CPU than the kernel's own work for it (about 9 us to
send and 20 us to receive on loopback), so the datagram transport moves datagrams in batches:
the message vectors are numpy arrays (`MMSGHDR`, `IOVEC`), filled arithmetically for a whole
tensor at once, and handed to the kernel in slices. Linux with glibc only; without the two
calls `mmsg_calls` raises `TransportError` rather than falling back to a slower path.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from netem.profile import ECN_CE, ECN_MASK
from testbed.transport.errors import TransportError


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_void_p),
        ("namelen", ctypes.c_uint32),  # socklen_t
        ("iov", ctypes.c_void_p),
        ("iovlen", ctypes.c_size_t),
        ("control", ctypes.c_void_p),
        ("controllen", ctypes.c_size_t),
        ("flags", ctypes.c_int),
    ]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", _Msghdr), ("len", ctypes.c_uint)]


# The C layouts as numpy dtypes (numpy takes the offsets from ctypes), so whole vectors of
# messages are filled with array arithmetic.
IOVEC = np.dtype(_Iovec)
MMSGHDR = np.dtype(_Mmsghdr)
NAME_BYTES = 32  # room for a sockaddr_in6 (28 bytes)
# Room for the one control message a datagram socket asks for: its IP_TOS (a byte) or
# IPV6_TCLASS (an int) after a struct cmsghdr (length, level, type).
CMSG_HEADER = 16
CONTROL_BYTES = 32
TRAFFIC_CLASS_MESSAGES = ((socket.IPPROTO_IP, socket.IP_TOS),
                          (socket.IPPROTO_IPV6, socket.IPV6_TCLASS))
MSG_DONTWAIT = socket.MSG_DONTWAIT


@functools.cache
def mmsg_calls() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """libc's (recvmmsg, sendmmsg); TransportError where the C library has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        recvmmsg, sendmmsg = libc.recvmmsg, libc.sendmmsg
    except AttributeError:
        raise TransportError(
            "the datagram transport needs recvmmsg(2) and sendmmsg(2) (Linux, glibc >= 2.14); "
            "this C library has none"
        ) from None
    recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
                         ctypes.c_void_p]
    sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    recvmmsg.restype = sendmmsg.restype = ctypes.c_int
    return recvmmsg, sendmmsg


def sockaddr(address: tuple[str, int]) -> bytes:
    """The C sockaddr of a numeric (host, port); ValueError for a name."""
    host, port = address[0], address[1]
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            packed = socket.inet_pton(family, host)
        except OSError:
            continue
        if family == socket.AF_INET:
            return struct.pack("=H", family) + struct.pack("!H", port) + packed + bytes(8)
        return struct.pack("=H", family) + struct.pack("!HI", port, 0) + packed + bytes(4)
    raise ValueError(f"address: {host!r} is not a numeric IPv4 or IPv6 address")


def address_of(name: bytes | memoryview) -> tuple[str, int]:
    """(host, port) of a C sockaddr written by the kernel."""
    family = struct.unpack_from("=H", name)[0]
    port = struct.unpack_from("!H", name, 2)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(family, bytes(name[4:8])), port
    return socket.inet_ntop(socket.AF_INET6, bytes(name[8:24])), port


class ReceiveRing:
    """`count` slots of `size` bytes (rows `stride` apart, a multiple of 64), each with the
    sender's address and room for a control message, filled by one recvmmsg call. `slots`,
    `lengths()` and `marked()` are views of the last call's datagrams, valid until the next."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.stride = -(-size // 64) * 64
        self.slots = np.zeros((count, self.stride), dtype=np.uint8)
        self.names = np.zeros((count, NAME_BYTES), dtype=np.uint8)
        self._iov = np.zeros(count, dtype=IOVEC)
        self._iov["base"] = self.slots.ctypes.data + self.stride * np.arange(count, dtype=np.uint64)
        self._iov["len"] = size
        self._msgs = np.zeros(count, dtype=MMSGHDR)
        header = self._msgs["hdr"]
        header["name"] = self.names.ctypes.data + NAME_BYTES * np.arange(count, dtype=np.uint64)
        header["iov"] = self._iov.ctypes.data + IOVEC.itemsize * np.arange(count, dtype=np.uint64)
        header["iovlen"] = 1
        header["namelen"] = NAME_BYTES
        self.control = np.zeros((count, CONTROL_BYTES), dtype=np.uint8)
        header["control"] = self.control.ctypes.data + CONTROL_BYTES * np.arange(
            count, dtype=np.uint64)
        header["controllen"] = CONTROL_BYTES
        # The kernel writes each used length back: reset them before the next call.
        self._namelen, self._controllen = header["namelen"], header["controllen"]
        self._used = 0
        self._address = self._msgs.ctypes.data
        self._recvmmsg = mmsg_calls()[0]

    def receive(self, fd: int) -> int:
        """Datagrams now queued on `fd`, up to `count`, without waiting; 0 if none. Raises
        OSError for any other error of the call (e.g. ECONNREFUSED of an earlier send)."""
        self._namelen[:self._used] = NAME_BYTES
        self._controllen[:self._used] = CONTROL_BYTES
        while True:
            got = self._recvmmsg(fd, self._address, self.count, MSG_DONTWAIT, None)
            if got >= 0:
                self._used = got
                return got
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if code != errno.EINTR:
                raise OSError(code, errno.errorcode.get(code, str(code)))

    def lengths(self, count: int) -> np.ndarray:
        """Bytes each of the last call's first `count` datagrams had (at most `size`)."""
        return self._msgs["len"][:count].astype(np.int64)

    def marked(self, count: int) -> np.ndarray:
        """Whether each of the last call's first `count` datagrams arrived marked CE, from the
        TOS / TCLASS byte the socket asked the kernel for (IP_RECVTOS / IPV6_RECVTCLASS;
        without them nothing reads as marked)."""
        control = self.control[:count]
        level = control[:, 8:12].copy().view(np.int32)[:, 0]
        kind = control[:, 12:16].copy().view(np.int32)[:, 0]
        carried = np.zeros(count, dtype=bool)
        for want_level, want_kind in TRAFFIC_CLASS_MESSAGES:
            carried |= (level == want_level) & (kind == want_kind)
        carried &= self._controllen[:count] > CMSG_HEADER
        return carried & ((control[:, CMSG_HEADER] & ECN_MASK) == ECN_CE)


@dataclass(frozen=True)
class Batch:
    """One tensor's messages to one address (`name`, a C sockaddr): message i is `headers[i]`
    followed by bytes `starts[i]:ends[i]` of the concatenation of `parts` ((address, nbytes)
    each; the caller keeps that memory alive while the messages are sent), then `trailers[i]`
    if there are trailers (a MAC each)."""

    name: bytes
    headers: np.ndarray  # (n, header bytes) uint8
    parts: Sequence[tuple[int, int]]
    starts: np.ndarray
    ends: np.ndarray
    trailers: np.ndarray | None = None  # (n, trailer bytes) uint8

    @property
    def overhead(self) -> int:
        """Bytes of each message besides its share of the parts."""
        return self.headers.shape[1] + (0 if self.trailers is None else self.trailers.shape[1])


class Outgoing:
    """The messages of one or more runs as one vector, interleaved in proportion to their
    lengths (run A's first, B's first, A's second...; each run's own in order), so a sender
    paced at a link's rate and sending to several peers at once gives each of them an even
    share at any moment; `run[i]` and `size[i]`: message i's run and bytes."""

    def __init__(self, runs: Sequence[Batch]) -> None:
        self._keep: list[object] = []  # what the message vector points into
        vectors = []
        for run in runs:
            n = len(run.starts)
            name = ctypes.create_string_buffer(run.name, len(run.name))
            columns = 1 + len(run.parts) + (run.trailers is not None)
            iov = np.zeros((n, columns), dtype=IOVEC)
            iov["base"][:, 0] = run.headers.ctypes.data + run.headers.shape[1] * np.arange(
                n, dtype=np.uint64)
            iov["len"][:, 0] = run.headers.shape[1]
            offset = 0
            for column, (address, nbytes) in enumerate(run.parts, start=1):
                lo = np.clip(run.starts - offset, 0, nbytes)
                hi = np.clip(run.ends - offset, 0, nbytes)
                iov["base"][:, column] = address + lo.astype(np.uint64)
                iov["len"][:, column] = hi - lo
                offset += nbytes
            if run.trailers is not None:
                iov["base"][:, -1] = run.trailers.ctypes.data + run.trailers.shape[1] * np.arange(
                    n, dtype=np.uint64)
                iov["len"][:, -1] = run.trailers.shape[1]
            msgs = np.zeros(n, dtype=MMSGHDR)
            header = msgs["hdr"]
            header["name"] = ctypes.addressof(name)
            header["namelen"] = len(run.name)
            header["iov"] = iov.ctypes.data + iov.strides[0] * np.arange(n, dtype=np.uint64)
            header["iovlen"] = columns
            vectors.append(msgs)
            self._keep += [name, iov, run.headers, run.trailers]
        counts = [len(run.starts) for run in runs]
        order = np.argsort(np.concatenate([(np.arange(n) + 0.5) / n for n in counts]),
                           kind="stable")
        self._msgs = np.concatenate(vectors)[order]
        self.run = np.repeat(np.arange(len(runs)), counts)[order]
        self.size = np.concatenate([run.overhead + run.ends - run.starts
                                    for run in runs])[order]
        self._address = self._msgs.ctypes.data
        self._sendmmsg = mmsg_calls()[1]

    def __len__(self) -> int:
        return len(self._msgs)

    def send(self, fd: int, start: int, count: int) -> tuple[int, int]:
        """Hand messages start..start+count-1 to the kernel: (how many it took, the errno that
        stopped it at the next one, or 0)."""
        while True:
            sent = self._sendmmsg(fd, self._address + start * MMSGHDR.itemsize, count, 0)
            if sent >= 0:
                return sent, 0
            code = ctypes.get_errno()
            if code != errno.EINTR:
                return 0, code
