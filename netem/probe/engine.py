"""Sending and receiving probe trains: the measuring half of the probes.

Both ends live in one process. A socket stays in the network namespace it was created in, so the
receiving socket is opened inside the destination namespace and the sending one inside the source
namespace; one event loop paces the sender and drains the receiver. No helper processes, pipes or
readiness handshakes: the receiver is bound before the first probe leaves.

Timing: the sender writes CLOCK_REALTIME into each probe just before sending it; the receiving
kernel stamps the datagram (SO_TIMESTAMPNS, the same clock of the same kernel) when it reaches the
destination namespace, so how late the receiving loop gets to run (slow in a UML guest) never
enters the one-way delay.

Probes go over IPv4 or IPv6, as the destination address is; over IPv6 the zero UDP checksum
needs a socket option at both ends (RFC 6936 allows it; Linux asks for it explicitly).

ECN: the receiver reads each arrival's ECN field (IP_RECVTOS / IPV6_RECVTCLASS); a train sent
ECN-capable (`ecn`: ECT(0) in every probe) counts how many a link marked CE instead of dropping
them, as netem's `ecn` does.

Throughput comes from a separate bulk train of MTU-sized datagrams sent with UDP segmentation
offload (one system call per ~44 datagrams: a UML guest cannot send 100 Mbit/s otherwise), from
the spacing of their kernel arrival stamps while the shaper's queue is kept busy.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import select
import socket
import struct
import time
from dataclasses import dataclass, field, replace

import numpy as np

from netem.namespace import NamespaceError, inside
from netem.probe.analysis import ProbeResult, Train, analyze, bulk_rate
from netem.probe.wire import (
    FRAME_OVERHEAD,
    HEADER,
    KIND_END,
    KIND_PROBE,
    KIND_WARMUP,
    MAGIC,
    STATUS_MALFORMED,
    STATUS_OK,
    VERSION,
    Decoded,
    ProbeError,
    check_word,
    decode,
    encode,
)
from netem.profile import ECN_CE, ECN_MASK, ECT_0, LinkProfile

DEFAULT_SIZE = 128  # UDP payload of a timed probe: small, so a 10 Mbit/s link is not congested
DEFAULT_INTERVAL = 0.0004  # 2500 probes/s: a UML guest keeps up with this, sending and receiving
DEFAULT_COUNT = 5000
END_SPACING = 0.01  # end-of-train markers repeat this often until one arrives
# The sender not running for this long (a send that returned this late after its stamp, or a
# wake-up this late after a probe was due) is a stall: on a busy host, or in a guest whose whole
# kernel the host descheduled, the probes stamped in it or due for delivery in it may be held up
# with it, so they are left out of the delay statistics (`analysis.held_by_stalls`).
SEND_STALL = 0.001
LINGER_MARGIN = 0.05  # extra wait after an end marker for probes still held by the link

# Linux socket options that Python's socket module does not name.
SO_NO_CHECK, SO_RCVBUFFORCE, SO_TIMESTAMPNS, SO_RXQ_OVFL = 11, 33, 35, 40
UDP_SEGMENT, IP_MTU = 103, 14
UDP_NO_CHECK6_TX, UDP_NO_CHECK6_RX, IPV6_MTU = 101, 102, 24
RECEIVE_BUFFER = 64 << 20  # holds a whole bulk train that is drained only after it was sent
GSO_MAX_BYTES = 65_000
GSO_MAX_SEGMENTS = 64
_ANCILLARY = socket.CMSG_SPACE(16) + 2 * socket.CMSG_SPACE(4)


@dataclass(frozen=True)
class _Family:
    """What differs between probing over IPv4 and over IPv6."""

    family: socket.AddressFamily
    headers: int  # bytes of IP and UDP header in front of a payload
    mtu: tuple[int, int]  # the option that reads a connected socket's path MTU
    send_unchecked: tuple[int, int]  # the sender's option for a zero UDP checksum
    take_unchecked: tuple[int, int] | None  # the receiver's, where it needs one
    traffic_class: tuple[int, int]  # the option that sets the TOS / TCLASS byte sent
    receive_class: tuple[int, int]  # the option that hands each arrival's byte to recvmsg


FAMILIES = {
    4: _Family(socket.AF_INET, 20 + 8, (socket.IPPROTO_IP, IP_MTU),
               (socket.SOL_SOCKET, SO_NO_CHECK), None,
               (socket.IPPROTO_IP, socket.IP_TOS), (socket.IPPROTO_IP, socket.IP_RECVTOS)),
    6: _Family(socket.AF_INET6, 40 + 8, (socket.IPPROTO_IPV6, IPV6_MTU),
               (socket.IPPROTO_UDP, UDP_NO_CHECK6_TX), (socket.IPPROTO_UDP, UDP_NO_CHECK6_RX),
               (socket.IPPROTO_IPV6, socket.IPV6_TCLASS),
               (socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS)),
}
ETHERNET_HEADER = FRAME_OVERHEAD - FAMILIES[4].headers


def _udp_socket(netns: str | None, family: _Family) -> socket.socket:
    """A UDP socket in `netns`; a namespace that cannot be entered is a ProbeError."""
    try:
        with inside(netns):
            return socket.socket(family.family, socket.SOCK_DGRAM)
    except NamespaceError as exc:
        raise ProbeError(str(exc)) from None


class _Receiver:
    """A bound UDP socket in the destination namespace that keeps the first `keep` bytes, the
    real length, the kernel arrival stamp and the ECN field of every datagram, in preallocated
    arrays."""

    def __init__(
        self,
        netns: str | None,
        address: str,
        *,
        family: _Family,
        run: int,
        size: int,
        keep: int,
        capacity: int,
    ) -> None:
        self.run, self.size, self.keep, self.capacity = run, size, keep, capacity
        self.sock = _udp_socket(netns, family)
        try:
            if family.take_unchecked is not None:
                self.sock.setsockopt(*family.take_unchecked, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            self.sock.setsockopt(*family.receive_class, 1)
            self.sock.bind((address, 0))
        except OSError as exc:
            self.sock.close()
            raise ProbeError(f"receiver on {address} in {netns}: {exc.strerror}") from None
        self.sock.setblocking(False)
        self.slots = np.zeros((capacity, keep), dtype=np.uint8)
        self.view = memoryview(self.slots).cast("B")
        self.lengths = np.zeros(capacity, dtype=np.int64)
        self.stamps = bytearray(16 * capacity)
        self.ecn = np.zeros(capacity, dtype=np.uint8)
        self._traffic_class = family.traffic_class  # (level, type) of the cmsg carrying it
        self.count = 0
        self.unread = 0
        self.drops = 0
        self.markers: dict[int, float] = {}  # kind -> monotonic time its first marker was read

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def drain(self) -> None:
        """Read every datagram queued now."""
        flags = socket.MSG_DONTWAIT | socket.MSG_TRUNC
        scratch = bytearray(self.keep)
        while True:
            n = self.count
            target = (
                self.view[n * self.keep : (n + 1) * self.keep] if n < self.capacity else scratch
            )
            try:
                length, ancillary, _, _ = self.sock.recvmsg_into([target], _ANCILLARY, flags)
            except BlockingIOError:
                return
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and n < self.capacity:
                    self.stamps[16 * n : 16 * n + 16] = data[:16]
                elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL:
                    self.drops = struct.unpack("I", data[:4])[0]
                elif (level, kind) == self._traffic_class and data and n < self.capacity:
                    self.ecn[n] = data[0] & ECN_MASK  # a byte (IPv4) or a host-order int (IPv6)
            if n >= self.capacity:
                self.unread += 1
                continue
            self.lengths[n] = length
            self.count = n + 1
            if length == self.size and target[5] != KIND_PROBE:
                self._marker(target)

    def _marker(self, data: memoryview | bytearray) -> None:
        """Note the first intact end or warm-up marker of each kind."""
        magic, version, kind, reserved, run, seq, sent, check = HEADER.unpack_from(data)
        if (
            (magic, version, reserved, run) == (MAGIC, VERSION, 0, self.run)
            and kind in (KIND_END, KIND_WARMUP)
            and check == check_word(run, kind, seq, sent)
        ):
            self.markers.setdefault(kind, time.monotonic())

    def wait(self, timeout: float) -> None:
        """Block until a datagram is queued or `timeout` passes, then drain."""
        if select.select([self.sock], [], [], max(timeout, 0))[0]:
            self.drain()

    def decoded(self) -> tuple[Decoded, np.ndarray]:
        """The datagrams read so far, decoded, and their arrival times (ns)."""
        n = self.count
        stamps = np.frombuffer(self.stamps, dtype=np.int64, count=2 * n).reshape(n, 2)
        recv_ns = stamps[:, 0] * 1_000_000_000 + stamps[:, 1]
        return decode(self.slots[:n], self.lengths[:n], run=self.run, size=self.size), recv_ns

    def marked(self) -> np.ndarray:
        """Whether each datagram read so far arrived marked CE."""
        return self.ecn[: self.count] == ECN_CE

    def linger(self) -> float:
        """How long to keep reading after the first end marker: probes sent before it may still
        be held by the link for up to (longest delay seen - the marker's delay)."""
        decoded, recv_ns = self.decoded()
        delays = (recv_ns - decoded.sent_ns) / 1e9
        ok = decoded.status != STATUS_MALFORMED
        ends, probes = ok & (decoded.kind == KIND_END), ok & (decoded.kind == KIND_PROBE)
        if not (ends.any() and probes.any()):
            return LINGER_MARGIN
        spread = float(delays[probes].max() - delays[ends][0])
        return 1.5 * max(spread, 0.0) + LINGER_MARGIN

    def close(self) -> None:
        self.sock.close()


class _Sender:
    """A UDP socket in the source namespace that writes probes into one reusable buffer."""

    def __init__(
        self,
        netns: str | None,
        destination: tuple[str, int],
        *,
        family: _Family,
        run: int,
        size: int,
        checksum: bool,
        ecn: bool = False,
    ) -> None:
        self.sock = _udp_socket(netns, family)
        if not checksum:
            self.sock.setsockopt(*family.send_unchecked, 1)
        if ecn:
            self.sock.setsockopt(*family.traffic_class, ECT_0)
        self.destination, self.run, self.size = destination, run, size
        self.buffer = bytearray(encode(run, 0, 0, size))

    def send(self, seq: int, kind: int = KIND_PROBE) -> tuple[int, int | None]:
        """Send one probe; returns its stamp (ns) and how long the send took after it (ns;
        None on an error)."""
        now = time.time_ns()
        HEADER.pack_into(
            self.buffer,
            0,
            MAGIC,
            VERSION,
            kind,
            0,
            self.run,
            seq,
            now,
            check_word(self.run, kind, seq, now),
        )
        try:
            self.sock.sendto(self.buffer, self.destination)
        except OSError:
            return now, None
        return now, time.time_ns() - now

    def close(self) -> None:
        self.sock.close()


def _family_of(address: str) -> _Family:
    try:
        return FAMILIES[ipaddress.ip_address(address).version]
    except ValueError:
        raise ProbeError(
            f"address: expected an IPv4 address or an IPv6 one, got {address!r}") from None


def _signal(receiver: _Receiver, sender: _Sender, kind: int, deadline: float) -> bool:
    """Send markers of `kind` every END_SPACING until one arrives or the deadline passes."""
    next_send = time.monotonic()
    while kind not in receiver.markers:
        now = time.monotonic()
        if now >= deadline:
            return False
        if now >= next_send:
            sender.send(0, kind)
            next_send = now + END_SPACING
        receiver.wait(min(next_send, deadline) - now)
    return True


def _finish(receiver: _Receiver, sender: _Sender, deadline: float) -> bool:
    """End the train: markers until one arrives, then read until the link can hold nothing
    more (or the deadline passes). Returns whether a marker arrived."""
    if not _signal(receiver, sender, KIND_END, deadline):
        return False
    stop = min(receiver.markers[KIND_END] + receiver.linger(), deadline)
    while (now := time.monotonic()) < stop:
        receiver.wait(stop - now)
    receiver.drain()
    return True


def run_train(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    count: int = DEFAULT_COUNT,
    interval: float = DEFAULT_INTERVAL,
    size: int = DEFAULT_SIZE,
    timeout: float = 5.0,
    ecn: bool = False,
) -> Train:
    """Send `count` probes of `size` bytes every `interval` seconds from namespace `source` to
    `address` (a socket bound in `destination`), and collect what arrived; with `ecn` the
    probes are ECN-capable (ECT(0)), so a link that marks instead of dropping can.

    A warm-up marker opens the train (sent until one arrives, at most `timeout` seconds);
    end-of-train markers close it: the receiver stops once one arrived and the link can hold
    nothing more, or `timeout` seconds after the last probe was due.
    """
    family = _family_of(address)
    if count < 1:
        raise ProbeError(f"count: expected at least 1 probe, got {count}")
    if size < HEADER.size:
        raise ProbeError(f"size: a probe needs at least {HEADER.size} bytes, got {size}")
    run = secrets.randbits(32)
    receiver = _Receiver(
        destination, address, family=family, run=run, size=size, keep=size,
        capacity=2 * count + 1024,
    )
    try:
        sender = _Sender(source, receiver.address, family=family, run=run, size=size,
                         checksum=False, ecn=ecn)
        try:
            _signal(receiver, sender, KIND_WARMUP, time.monotonic() + timeout)
            errors: list[int] = []
            stalls: list[tuple[int, int]] = []  # (from, to) ns: the sender did not run
            start = last = time.monotonic()
            seq = 0
            while seq < count:
                # A sender that fell behind catches up at twice its pace, never in one burst:
                # `compare` judges delays only where the nominal load is at most half a link's
                # rate, so even catching up the train never queues behind itself there.
                now = time.monotonic()
                due = max(start + seq * interval, last + interval / 2) if seq else start
                if now < due:
                    receiver.wait(due - now)
                    continue
                late = now - due
                stamp, took = sender.send(seq)
                if late > SEND_STALL:  # woke that much after the probe was due
                    stalls.append((stamp - int(late * 1e9), stamp))
                if took is None:
                    errors.append(seq)
                elif took > SEND_STALL * 1e9:  # descheduled between the stamp and the kernel
                    stalls.append((stamp, stamp + took))
                seq += 1
                last = now
            spacing = (time.monotonic() - start) / max(count - 1, 1)
            ended = _finish(receiver, sender, time.monotonic() + timeout)
        finally:
            sender.close()
        decoded, recv_ns = receiver.decoded()
        probes = (decoded.status != STATUS_MALFORMED) & (decoded.kind == KIND_PROBE)
        return Train(
            sent=count,
            size=size,
            seq=decoded.seq[probes],
            sent_ns=decoded.sent_ns[probes],
            recv_ns=recv_ns[probes],
            payload_ok=decoded.status[probes] == STATUS_OK,
            marked=receiver.marked()[probes],
            ecn_capable=ecn,
            malformed=int((decoded.status == STATUS_MALFORMED).sum()),
            send_errors=np.asarray(errors, dtype=np.int64),
            stalls=np.asarray(stalls, dtype=np.int64).reshape(-1, 2),
            receiver_drops=receiver.drops,
            unread=receiver.unread,
            ended=ended,
            interval=spacing,
        )
    finally:
        receiver.close()


@dataclass(frozen=True)
class RateResult:
    """A bulk train: bits per second of frames arriving, over how many frames of what size,
    and when each arrived (the kernel's stamp, CLOCK_REALTIME ns: a rate over time)."""

    rate: float
    frames: int
    frame_bytes: int
    offered: float  # bits per second the sender achieved
    arrivals_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def measure_rate(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    duration: float = 1.0,
    offered: float | None = None,
    timeout: float = 5.0,
) -> RateResult:
    """Push MTU-sized datagrams through the link for `duration` seconds and time their arrival.

    `offered` (bits/s of frames) paces the sender, e.g. 1.25x the rate under test, so the
    shaper's queue stays busy without flooding; None sends back to back. Datagrams leave in
    segmentation-offload batches (one send per ~44), which is what lets a UML guest exceed
    100 Mbit/s; the receiver keeps only headers.
    """
    family = _family_of(address)
    run = secrets.randbits(32)
    probe_sock = _udp_socket(source, family)
    try:
        probe_sock.connect((address, 9))
        mtu = probe_sock.getsockopt(*family.mtu)
    except OSError as exc:
        raise ProbeError(f"no route to {address} from {source}: {exc.strerror}") from None
    finally:
        probe_sock.close()
    size = mtu - family.headers  # a datagram that fills the MTU
    frame = mtu + ETHERNET_HEADER
    batch = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // size))
    expected_frames = (offered or 10e9) * (duration + timeout) / (frame * 8)
    receiver = _Receiver(
        destination,
        address,
        family=family,
        run=run,
        size=size,
        keep=HEADER.size,
        capacity=int(min(expected_frames, 1_000_000)) + 1024,
    )
    try:
        sender = _Sender(source, receiver.address, family=family, run=run, size=size,
                         checksum=True)
        try:
            sender.sock.setsockopt(socket.IPPROTO_UDP, UDP_SEGMENT, size)
            sender.sock.connect(receiver.address)
            chunk = bytearray(bytes(sender.buffer) * batch)
            _signal(receiver, sender, KIND_WARMUP, time.monotonic() + timeout)
            seq = 0
            start = time.monotonic()
            while (now := time.monotonic()) < start + duration:
                if offered and seq * frame * 8 > offered * (now - start):
                    receiver.wait(seq * frame * 8 / offered - (now - start))
                    continue
                stamp = time.time_ns()
                for i in range(batch):
                    HEADER.pack_into(
                        chunk,
                        i * size,
                        MAGIC,
                        VERSION,
                        KIND_PROBE,
                        0,
                        run,
                        seq + i,
                        stamp,
                        check_word(run, KIND_PROBE, seq + i, stamp),
                    )
                with contextlib.suppress(OSError):  # ICMP errors, full queues: counted as not sent
                    sender.sock.send(chunk)
                    seq += batch
            elapsed = time.monotonic() - start
            _finish(receiver, sender, time.monotonic() + timeout)
        finally:
            sender.close()
        decoded, recv_ns = receiver.decoded()
        probes = (decoded.status == STATUS_OK) & (decoded.kind == KIND_PROBE)
        return RateResult(
            rate=bulk_rate(recv_ns[probes], frame),
            frames=int(probes.sum()),
            frame_bytes=frame,
            offered=seq * frame * 8 / elapsed,
            arrivals_ns=np.sort(recv_ns[probes]),
        )
    finally:
        receiver.close()


def offered_load(profile: LinkProfile) -> float | None:
    """What a bulk train should offer to keep this profile's rate limiter busy: 1.25x its rate,
    more to make up for the loss netem applies before the limiter. None if no rate is set."""
    if profile.rate is None:
        return None
    return 1.25 * profile.rate / max(1 - profile.mean_loss, 0.05)


def probe(
    source: str | None,
    destination: str | None,
    address: str,
    *,
    count: int = DEFAULT_COUNT,
    interval: float = DEFAULT_INTERVAL,
    size: int = DEFAULT_SIZE,
    rate_duration: float = 0.0,
    offered_rate: float | None = None,
    timeout: float = 5.0,
    trains: int = 5,
    ecn: bool = False,
) -> ProbeResult:
    """Measure the link from namespace `source` to `address` in namespace `destination` (None:
    this process's namespace): a timed probe train (ECN-capable with `ecn`), then, if
    `rate_duration` > 0, a bulk train for the rate. A timed train that found the host too
    busy to time it (`too_busy`: stalls of the sender held up all but a few of its probes) is
    sent again, `trains` at most; the result is the last train's, and says how many were
    sent."""
    if trains < 1:
        raise ProbeError(f"trains: expected at least 1, got {trains}")
    sent = 0
    while True:
        sent += 1
        result = analyze(
            run_train(source, destination, address, count=count, interval=interval, size=size,
                      timeout=timeout, ecn=ecn)
        )
        if sent == trains or not result.too_busy:
            break
    result = replace(result, trains=sent)
    if rate_duration <= 0:
        return result
    bulk = measure_rate(
        source, destination, address, duration=rate_duration, offered=offered_rate, timeout=timeout
    )
    return replace(
        result,
        rate=bulk.rate,
        rate_frames=bulk.frames,
        rate_frame_bytes=bulk.frame_bytes,
        rate_offered=bulk.offered,
    )
