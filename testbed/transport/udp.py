"""UDP datagrams for the lossy paths: tensors cut into MTU-sized chunks, paced, and collected
per (kind, step, bucket) until everything expected arrived or a deadline passed.

One thread drives an endpoint. Whenever it waits (for pacing tokens while sending, for chunks
while collecting) it reads its socket, so datagrams from peers that send while this worker does
are buffered in the process instead of overflowing the kernel's receive buffer. Chunks of keys
nobody is collecting yet wait in the endpoint until they are; chunks of a key already collected
are late: counted, dropped.

Loss is measured from sequence numbers: every (sender incarnation, destination) stream numbers
its datagrams from 0, so gaps at the receiver are datagrams lost on the way, whatever took them.
The part the host took (the socket's receive buffer was full) is the kernel's per-socket drop
count (`SocketCounters.rcvbuf_drops`); the rest was the network.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import secrets
import select
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from testbed.transport.counters import (
    UNKNOWN_PEER,
    DatagramCounters,
    SocketCounters,
    socket_drops,
)
from testbed.transport.errors import TransportError
from testbed.transport.tensors import as_bytes, bits, codec_of, dtype_of
from testbed.transport.wire import (
    ETHERNET_HEADER,
    HEADER_SIZE,
    IPV4_HEADER,
    IPV6_HEADER,
    MAGIC,
    UDP_HEADER,
    VERSION,
    Codec,
    Header,
    Kind,
    MalformedDatagram,
    Reason,
    chunk_numel,
    decode,
    encode_headers,
    payload_capacity,
)

SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # Linux; beyond rmem_max/wmem_max, needs CAP_NET_ADMIN
# Never fragment (one lost fragment loses the datagram): a datagram too large for the path is
# refused with EMSGSIZE, so a wrong `mtu` is an error at once instead of silent fragmentation.
IP_MTU_DISCOVER, IPV6_MTU_DISCOVER, PMTUDISC_DO = 10, 23, 2
DRAIN_BATCH = 1024  # datagrams read per drain, so a flood cannot hold a deadline hostage
# A sender's stream has ended once one of its last TAIL chunks came: paced datagrams of one
# stream arrive in order, so what it still lacks then was lost, not in flight.
TAIL = 4
JOINED_LATE = 64  # a stream first seen at this sequence number or beyond was joined late
BURST_SECONDS = 0.002  # default pacing burst: 2 ms of traffic (a wake-up is late by ~1 ms)

Key = tuple[int, int, int]  # (kind, step, bucket)


class TokenBucket:
    """Pacing: `rate` bits/s on average, at most `burst` bytes back to back. Sending more than
    the bucket holds puts it in debt; the caller waits the returned time off before sending."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"pacing: rate and burst must be positive, got {rate}, {burst}")
        self.rate = rate / 8
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, nbytes: int, now: float) -> float:
        """Spend `nbytes`; seconds to wait before sending them."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - nbytes
        self.stamp = now
        return max(0.0, -self.tokens / self.rate)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One received chunk of a tensor: elements index * chunk_numel onwards."""

    sender: int
    index: int
    count: int
    codec: Codec
    payload: memoryview
    arrival: float  # time.monotonic() when the endpoint read it

    def values(self) -> torch.Tensor:
        """The payload as a tensor (a view of the received bytes, no copy)."""
        if not self.payload:
            return torch.empty(0, dtype=dtype_of(self.codec))
        return torch.frombuffer(self.payload, dtype=dtype_of(self.codec))


@dataclass
class Collected:
    """What `collect` got for one key: the chunks (first copy of each (sender, index)), the
    expected (sender, index) pairs that did not come in time, how many datagrams of this kind
    came late for keys closed before (a deadline that was too short), in all and per sender,
    and when the last in-time chunk came (time.monotonic(); None if none did). Per sender
    that sent any in time: when its first and its last chunk of the key came."""

    chunks: list[Chunk]
    missing: set[tuple[int, int]]
    late: int
    last_arrival: float | None
    late_from: dict[int, int] = dataclasses.field(default_factory=dict)
    first_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    last_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)


@dataclass
class _Awaited:
    """The key a `collect` is waiting on, kept current by every accepted datagram."""

    key: Key
    wanted: set[tuple[int, int]]
    outstanding: Counter[int]  # per sender, how many of its wanted chunks have not come
    ended: set[int]  # senders whose stream reached its tail
    newest: float  # when its newest chunk came
    landings: dict[int, _Landing]
    first: dict[int, float]  # per sender, when its first chunk of the key came
    last: dict[int, float]  # per sender, when its latest chunk of the key came

    def arrived(self, sender: int, index: int, count: int, now: float) -> None:
        if (sender, index) in self.wanted:
            self.wanted.discard((sender, index))
            self.outstanding[sender] -= 1
        self.first.setdefault(sender, now)
        self.last[sender] = now
        self.newest = max(self.newest, now)
        if index >= count - TAIL:
            self.ended.add(sender)


EMPTY = memoryview(b"")
CODECS = {codec.value: codec for codec in Codec}  # Codec(value) costs microseconds per datagram


class _Landing:
    """Where one sender's chunks of the awaited key are written as they come: chunk i of a
    tensor as long as `out` at element i * chunk_numel of it."""

    __slots__ = ("chunk_bytes", "codec", "count", "target")

    def __init__(self, out: torch.Tensor, chunk_numel: int) -> None:
        self.target = memoryview(bits(out)).cast("B")
        self.codec = codec_of(out.dtype)
        self.chunk_bytes = chunk_numel * out.element_size()
        self.count = max(1, math.ceil(out.numel() / chunk_numel))

    def land(self, index: int, count: int, codec: int, payload: memoryview) -> bool:
        """Write one chunk; False if it is not a chunk of such a tensor (its numbers came from
        the network, so nothing is written outside `out`)."""
        start = index * self.chunk_bytes
        end = start + len(payload)
        if (codec != self.codec or count != self.count or len(payload) > self.chunk_bytes
                or end > len(self.target)):
            return False
        self.target[start:end] = payload
        return True


def place(chunks: Sequence[Chunk], out: torch.Tensor, chunk_numel: int) -> np.ndarray:
    """Copy chunks into the flat contiguous `out` (chunk i at element i * chunk_numel) in one
    vectorised scatter. Returns which chunks fit (same codec as `out`, inside it); the others
    are left out, since their numbers came from the network."""
    target = bits(out)
    n = len(chunks)
    index = np.fromiter((c.index for c in chunks), np.int64, n)
    numel = np.fromiter((len(c.payload) for c in chunks), np.int64, n) // out.element_size()
    codec = np.fromiter((c.codec for c in chunks), np.int64, n)
    start = index * chunk_numel
    fits = (codec == codec_of(out.dtype)) & (numel <= chunk_numel) & (start + numel <= target.size)
    chosen = np.flatnonzero(fits)
    joined = b"".join([chunks[i].payload for i in chosen.tolist()])
    values = np.frombuffer(joined, dtype=target.dtype)
    lengths = numel[chosen]
    # value k belongs to the chunk whose run of values holds k: its start plus k's place in it
    shift = np.repeat(start[chosen] - (np.cumsum(lengths) - lengths), lengths)
    target[shift + np.arange(values.size)] = values
    return fits


class _Sequence:
    """The sequence numbers one sender incarnation's stream delivered: the highest, and which
    of the `window` below it came (bit i of `seen`: highest - i). Anything already seen or
    older than the window is a replay."""

    __slots__ = ("base", "full", "highest", "incarnation", "received", "seen", "window")

    def __init__(self, incarnation: int, first: int, window: int) -> None:
        self.incarnation = incarnation
        self.window = window
        self.full = (1 << window) - 1
        # Streams start at 0; one first seen at JOINED_LATE or beyond was joined late (this
        # endpoint restarted while its peers went on), and counting from 0 would call everything
        # before it lost. (A fresh stream whose first JOINED_LATE datagrams were all lost is
        # counted from its first arrival instead: at most that many uncounted.)
        self.base = first if first >= JOINED_LATE else 0
        self.highest = self.base - 1
        self.seen = 0
        self.received = 0

    def accept(self, seq: int) -> bool:
        ahead = seq - self.highest
        if ahead > 0:
            self.seen = ((self.seen << ahead) | 1) & self.full if ahead < self.window else 1
            self.highest = seq
        elif -ahead >= self.window or seq < self.base or self.seen >> -ahead & 1:
            return False
        else:
            self.seen |= 1 << -ahead
        self.received += 1
        return True

    @property
    def lost(self) -> int:
        return self.highest + 1 - self.base - self.received


class DatagramEndpoint:
    """This worker's UDP socket: sends tensors to peers as chunks, collects chunks by key.

    `mtu` sizes the chunks (no datagram is larger than one IP packet of `mtu` bytes); `rate`
    (bits/s of Ethernet frames, what a qdisc counts) paces sending, None sends as fast as the
    socket takes it. `rcvbuf`/`sndbuf` are asked of the kernel (beyond rmem_max when root);
    `rcvbuf_bytes`/`sndbuf_bytes` say what it granted (Linux doubles the request for its own
    bookkeeping). Keys more than `history_steps` below the newest collected step are closed.
    """

    def __init__(
        self,
        rank: int,
        run_id: int,
        address: tuple[str, int] = ("0.0.0.0", 0),
        *,
        peers: Mapping[int, tuple[str, int]] | None = None,
        mtu: int = 1500,
        rate: float | None = None,
        burst: int | None = None,
        rcvbuf: int = 4 << 20,
        sndbuf: int = 1 << 20,
        replay_window: int = 4096,
        history_steps: int = 8,
    ) -> None:
        ipv6 = ":" in address[0]
        self.rank, self.run_id, self.mtu, self._ipv6 = rank, run_id, mtu, ipv6
        self.capacity = payload_capacity(mtu, ipv6=ipv6)
        self._full = {codec: self.chunk_numel(codec) * codec.itemsize for codec in Codec}
        self.incarnation = secrets.randbits(32)
        self.replay_window, self.history_steps = replay_window, history_steps
        self._frame_overhead = ETHERNET_HEADER + (IPV6_HEADER if ipv6 else IPV4_HEADER) + UDP_HEADER
        self._bucket = None
        if rate is not None:
            burst = burst or max(4 * mtu, int(rate / 8 * BURST_SECONDS))
            self._bucket = TokenBucket(rate, burst, time.monotonic())
        self._sock = socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.rcvbuf_bytes = _buffer(self._sock, socket.SO_RCVBUF, SO_RCVBUFFORCE, rcvbuf)
            self.sndbuf_bytes = _buffer(self._sock, socket.SO_SNDBUF, SO_SNDBUFFORCE, sndbuf)
            if ipv6:
                self._sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, PMTUDISC_DO)
            else:
                self._sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, PMTUDISC_DO)
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            where = f"rank {rank}: UDP endpoint on {address[0]}:{address[1]}"
            raise TransportError(f"{where}: {exc.strerror}") from None
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._peers: dict[int, tuple[str, int]] = {}
        self._ranks: dict[tuple[str, int], int] = {}
        self._next_seq: dict[int, int] = defaultdict(int)
        self._counters: dict[int, DatagramCounters] = defaultdict(DatagramCounters)
        self._sequences: dict[int, _Sequence] = {}
        self._retired: dict[int, set[int]] = defaultdict(set)
        self._lost_before: Counter[int] = Counter()
        self._rejected: Counter[Reason] = Counter()
        self._receive_errors = 0
        self._rcvbuf_drops = 0
        self._pending: dict[Key, dict[tuple[int, int], Chunk]] = {}
        self._awaited: _Awaited | None = None
        self._closed: set[Key] = set()
        self._closed_below = 0  # every step below this is closed
        self._late: Counter[tuple[int, int]] = Counter()  # per (kind, sender)
        for peer, peer_address in (peers or {}).items():
            self.add_peer(peer, peer_address)

    def add_peer(self, rank: int, address: tuple[str, int]) -> None:
        """Where `rank` is (numeric address): where its chunks go, and whose datagrams that
        fail to decode are counted against."""
        self._peers[rank] = address
        self._ranks[address] = rank

    def chunk_numel(self, codec: Codec = Codec.FLOAT32) -> int:
        """Elements per chunk; chunk i of a tensor holds elements i * chunk_numel onwards."""
        return chunk_numel(self.mtu, codec, ipv6=self._ipv6)

    def send_tensor(
        self,
        peer: int,
        kind: Kind,
        step: int,
        bucket: int,
        tensor: torch.Tensor | np.ndarray,
    ) -> int:
        """Send a tensor to `peer` as chunks (one datagram each), paced; returns the chunk count.

        A datagram the kernel refuses (ENOBUFS, EPERM from a firewall, an unreachable network)
        is counted in `send_errors` and its sequence number stays used, so the receiver counts
        it lost too: it never reached the wire.
        """
        address = self._peers.get(peer)
        if address is None:
            raise TransportError(f"rank {self.rank}: no address for peer {peer}; known: "
                                 f"{sorted(self._peers)}")
        codec, data = as_bytes(tensor)
        capacity = self.chunk_numel(codec) * codec.itemsize
        starts = np.arange(0, max(len(data), 1), capacity)
        ends = np.minimum(starts + capacity, len(data))
        template = Header(MAGIC, VERSION, kind, codec, self.rank, self.run_id, self.incarnation,
                          0, step, bucket, 0, 0, 0)
        headers = encode_headers(template, self._next_seq[peer], ends - starts)
        self._next_seq[peer] += len(starts)
        counters = self._counters[peer]
        for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            size = HEADER_SIZE + end - start
            if self._bucket is not None:
                self._pace(size + self._frame_overhead)
            try:
                self._sock.sendmsg([headers[i], data[start:end]], (), 0, address)
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:
                    raise TransportError(
                        f"rank {self.rank}: a {size}-byte datagram to peer {peer} at {address} "
                        f"is too large ({exc.strerror}); is mtu={self.mtu} right for this path?"
                    ) from None
                counters.send_errors += 1
                continue
            counters.datagrams_sent += 1
            counters.bytes_sent += size
        return len(starts)

    def collect(
        self,
        kind: Kind,
        step: int,
        bucket: int,
        expected: Collection[tuple[int, int]],
        deadline: float,
        *,
        settle: float | None = None,
        into: Mapping[int, torch.Tensor] | None = None,
        transfer: float | None = None,
        start_by: Mapping[int, float] | None = None,
    ) -> Collected:
        """Chunks of (kind, step, bucket) until every expected (sender, index) came or
        time.monotonic() passes `deadline`. The key is closed afterwards: later chunks of it
        are late.

        With `settle`, the wait also ends once every expected sender's stream has ended (one
        of its last TAIL chunks came) and nothing came for `settle` seconds: the rest was lost.
        Under loss that ends a call when the data stops rather than at the deadline, which
        then only bounds the wait for senders that are slow or gone.

        With `into`, the chunks of those senders are written into their tensor (flat,
        contiguous; chunk i at element i * chunk_numel) as they come instead of being kept:
        their `Collected.chunks` carry no payload, and a chunk that is not one of a tensor of
        that length and dtype is left out as if it never came. Nothing but the destination
        holds the data, which keeps a large collect's memory at the tensor's size.

        With `transfer`, each sender gets its own limit: `transfer` seconds after its first
        chunk of the key came, or, while none has, until `start_by[sender]` (time.monotonic();
        default `deadline`). The wait ends once no sender that still owes chunks is within its
        limit. So a sender that starts late (it computed longer) is waited for as long as
        `start_by` allows, and its stream as long as a stream takes, whatever its start;
        `deadline` still bounds the whole wait."""
        key = (int(kind), step, bucket)
        if step < self._closed_below or key in self._closed:
            raise ValueError(f"collect: {Kind(kind).name} step {step} bucket {bucket} is closed")
        late_before = Counter({sender: count for (kind_, sender), count in self._late.items()
                               if kind_ == key[0]})
        got = self._pending.setdefault(key, {})
        landings = {sender: _Landing(out, self._full[codec_of(out.dtype)] // out.element_size())
                    for sender, out in (into or {}).items()}
        for spot, chunk in list(got.items()):  # what came before anyone waited for it
            landing = landings.get(chunk.sender)
            if landing is None:
                continue
            if landing.land(chunk.index, chunk.count, chunk.codec, chunk.payload):
                got[spot] = dataclasses.replace(chunk, payload=EMPTY)
            else:
                del got[spot]
        wanted = set(expected) - got.keys()
        awaited = self._awaited = _Awaited(
            key, wanted, Counter(sender for sender, _ in wanted), set(),
            -math.inf, landings, {}, {},
        )
        for chunk in sorted(got.values(), key=lambda c: c.arrival):
            awaited.arrived(chunk.sender, chunk.index, chunk.count, chunk.arrival)
        if not got:
            awaited.newest = time.monotonic()
        try:
            self._drain()
            while awaited.wanted:
                now = time.monotonic()
                limits = self._limits(awaited, deadline, transfer, start_by or {}, now)
                if not limits:
                    break
                until = max(limits.values())
                if settle is not None and awaited.ended >= limits.keys():
                    quiet = awaited.newest + settle
                    if quiet <= now:
                        break
                    until = min(until, quiet)
                self._wait(until - now)
        finally:
            self._awaited = None
            del self._pending[key]
            self._close(key)
        chunks = list(got.values())
        late_from = {sender: count - late_before[sender]
                     for (kind_, sender), count in self._late.items()
                     if kind_ == key[0] and count > late_before[sender]}
        return Collected(
            chunks=chunks,
            missing=awaited.wanted,
            late=sum(late_from.values()),
            last_arrival=max((c.arrival for c in chunks), default=None),
            late_from=late_from,
            first_arrivals=awaited.first,
            last_arrivals=awaited.last,
        )

    @staticmethod
    def _limits(awaited: _Awaited, deadline: float, transfer: float | None,
                start_by: Mapping[int, float], now: float) -> dict[int, float]:
        """The senders that still owe chunks and are within their limit, with that limit."""
        limits = {}
        for sender, owed in awaited.outstanding.items():
            if owed <= 0:
                continue
            limit = deadline
            if transfer is not None:
                first = awaited.first.get(sender)
                limit = min(deadline, first + transfer if first is not None
                            else start_by.get(sender, deadline))
            if limit > now:
                limits[sender] = limit
        return limits

    def poll(self, timeout: float = 0.0) -> None:
        """Read what is queued, waiting up to `timeout` seconds for something to come."""
        self._wait(timeout)

    def counters(self) -> dict[int, DatagramCounters]:
        """A snapshot per peer (UNKNOWN_PEER: undecodable datagrams from unknown addresses)."""
        snapshot = {}
        for peer in sorted(self._counters):
            counters = dataclasses.replace(self._counters[peer])
            sequence = self._sequences.get(peer)
            counters.datagrams_lost = self._lost_before[peer] + (sequence.lost if sequence else 0)
            snapshot[peer] = counters
        return snapshot

    def socket_counters(self) -> SocketCounters:
        """A snapshot; rcvbuf_drops as of now (or of `close`)."""
        if self._sock.fileno() >= 0:
            self._rcvbuf_drops = socket_drops(self._sock)
        return SocketCounters(
            rcvbuf_drops=self._rcvbuf_drops,
            receive_errors=self._receive_errors,
            rcvbuf_bytes=self.rcvbuf_bytes,
            sndbuf_bytes=self.sndbuf_bytes,
            rejected={reason.value: count for reason, count in sorted(self._rejected.items())},
        )

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._rcvbuf_drops = socket_drops(self._sock)
            self._sock.close()

    def __enter__(self) -> DatagramEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- receiving --------------------------------------------------------------------------

    def _wait(self, timeout: float) -> None:
        if self._poll.poll(max(timeout, 0.0) * 1000):
            self._drain()

    def _drain(self) -> None:
        """Read up to DRAIN_BATCH queued datagrams. Nothing a peer sends makes this raise."""
        for _ in range(DRAIN_BATCH):
            buffer = bytearray(HEADER_SIZE + self.capacity + 1)  # one more: see oversize
            try:
                size, source = self._sock.recvfrom_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self._receive_errors += 1
                return
            self._accept(memoryview(buffer)[:size], source[:2], time.monotonic())

    def _accept(self, datagram: memoryview, source: tuple[str, int], now: float) -> None:
        try:
            if len(datagram) > HEADER_SIZE + self.capacity:
                raise MalformedDatagram(Reason.OVERSIZE)
            header = decode(datagram, self.run_id)
            full = self._full[header.codec]
            if header.payload_len > full or (
                header.chunk < header.chunks - 1 and header.payload_len != full
            ):
                raise MalformedDatagram(Reason.MTU_MISMATCH)
        except MalformedDatagram as exc:
            self._reject(self._ranks.get(source, UNKNOWN_PEER), exc.reason)
            return
        sender = header.sender
        sequence = self._sequence(sender, header.incarnation, header.seq)
        if sequence is None or not sequence.accept(header.seq):
            self._reject(sender, Reason.REPLAYED)
            return
        counters = self._counters[sender]
        counters.datagrams_received += 1
        counters.bytes_received += len(datagram)
        key = (header.kind, header.step, header.bucket)
        if header.step < self._closed_below or key in self._closed:
            counters.datagrams_late += 1
            self._late[header.kind, sender] += 1
            return
        payload = datagram[HEADER_SIZE:]
        awaited = self._awaited
        if awaited is not None and awaited.key == key:
            landing = awaited.landings.get(sender)
            if landing is not None:
                if not landing.land(header.chunk, header.chunks, header.codec, payload):
                    return
                payload = EMPTY
        chunk = Chunk(sender, header.chunk, header.chunks, CODECS[header.codec], payload, now)
        self._pending.setdefault(key, {}).setdefault((sender, header.chunk), chunk)
        if awaited is not None and awaited.key == key:
            awaited.arrived(sender, header.chunk, header.chunks, now)

    def _sequence(self, sender: int, incarnation: int, seq: int) -> _Sequence | None:
        """The sender's stream; a new incarnation (the sender restarted) retires the old one,
        whose datagrams are replays from then on."""
        sequence = self._sequences.get(sender)
        if sequence is not None and sequence.incarnation == incarnation:
            return sequence
        if incarnation in self._retired[sender]:
            return None
        if sequence is not None:
            self._retired[sender].add(sequence.incarnation)
            self._lost_before[sender] += sequence.lost
        sequence = self._sequences[sender] = _Sequence(incarnation, seq, self.replay_window)
        return sequence

    def _reject(self, peer: int, reason: Reason) -> None:
        self._rejected[reason] += 1
        counters = self._counters[peer]
        name = f"datagrams_{reason.category}"
        setattr(counters, name, getattr(counters, name) + 1)

    def _close(self, key: Key) -> None:
        """Close a key; keys of steps that fell out of the history are closed too, and what
        was waiting in them is late."""
        self._closed.add(key)
        floor = key[1] - self.history_steps
        if floor <= self._closed_below:
            return
        self._closed_below = floor
        self._closed = {k for k in self._closed if k[1] >= floor}
        for old in [k for k in self._pending if k[1] < floor]:
            for chunk in self._pending.pop(old).values():
                self._counters[chunk.sender].datagrams_late += 1
                self._late[old[0], chunk.sender] += 1

    # -- sending ----------------------------------------------------------------------------

    def _pace(self, frame_bytes: int) -> None:
        """Wait for pacing tokens, reading the socket meanwhile."""
        now = time.monotonic()
        until = now + self._bucket.take(frame_bytes, now)
        while (remaining := until - time.monotonic()) > 0:
            self._wait(remaining)


def _buffer(sock: socket.socket, option: int, force: int, size: int) -> int:
    """Ask for a socket buffer (forced past the sysctl limit if allowed); what was granted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return sock.getsockopt(socket.SOL_SOCKET, option)


def expected_chunks(senders: Collection[int], numel: int, chunk_numel: int) -> set[tuple[int, int]]:
    """The (sender, index) pairs of a `numel`-element tensor from each sender."""
    count = max(1, math.ceil(numel / chunk_numel))
    return {(sender, index) for sender in senders for index in range(count)}
