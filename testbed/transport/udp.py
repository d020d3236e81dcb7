"""UDP datagrams for the lossy paths: tensors cut into MTU-sized chunks, paced, and collected
per (kind, step, bucket) until everything expected arrived or a deadline passed.

Datagrams move in batches: `sendmmsg` hands a paced run of a tensor's chunks to the kernel in
one call, `recvmmsg` reads up to a ring's worth at once, and each batch's headers are checked,
sequenced and routed with numpy (`testbed.transport.mmsg`). A chunk lands where its collector
said it belongs (a `Sink`: a tensor, or e.g. a running sum) as it is read, so nothing but the
destination holds its data.

One thread drives an endpoint. Whenever it waits (for pacing tokens while sending, for chunks
while collecting) it reads its socket, so datagrams from peers that send while this worker does
are taken in instead of overflowing the kernel's receive buffer. A key is opened (`open`, or
`collect` itself) before its chunks are due: chunks of keys nobody opened yet wait in the
endpoint until somebody does; chunks of a key already collected are late: counted, dropped.

Loss is measured from sequence numbers: every (sender incarnation, destination) stream numbers
its datagrams from 0, so gaps at the receiver are datagrams lost on the way, whatever took them.
The part the host took (the socket's receive buffer was full) is the kernel's per-socket drop
count (`SocketCounters.rcvbuf_drops`); the rest was the network.

Nothing a datagram says about itself is taken on its word. Before a datagram reaches a stream,
a key or a sum, its header has been checked (`wire.rejections`), its source address is the one
registered for the sender it names (`sources.SourceTable`), and, with the run's key, its MAC
proves the key (`auth.DatagramMac`); each batch at once, and what fails is counted by reason
against the peer whose address it came from. docs/transport.md states what this stops.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import secrets
import select
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from testbed.transport.auth import MAC_SIZE, DatagramMac
from testbed.transport.counters import DatagramCounters, SocketCounters, socket_drops
from testbed.transport.errors import TransportError
from testbed.transport.mmsg import Batch, Outgoing, ReceiveRing, mmsg_calls, sockaddr
from testbed.transport.sources import SourceTable
from testbed.transport.tensors import as_bytes, bits, bits_dtype, codec_of, dtype_of
from testbed.transport.wire import (
    ACCEPTED,
    ETHERNET_HEADER,
    HEADER_SIZE,
    IPV4_HEADER,
    IPV6_HEADER,
    ITEMSIZE,
    MAGIC,
    REASONS,
    UDP_HEADER,
    VERSION,
    Codec,
    Header,
    Kind,
    Reason,
    code_of,
    encode_headers,
    full_payload,
    headers_of,
    payload_capacity,
    rejections,
)

SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # Linux; beyond rmem_max/wmem_max, needs CAP_NET_ADMIN
# Never fragment (one lost fragment loses the datagram): a datagram too large for the path is
# refused with EMSGSIZE, so a wrong `mtu` is an error at once instead of silent fragmentation.
IP_MTU_DISCOVER, IPV6_MTU_DISCOVER, PMTUDISC_DO = 10, 23, 2
DRAIN_BATCH = 1024  # datagrams read per drain, so a flood cannot hold a deadline hostage
RING_BYTES = 1 << 20  # the receive ring: this many bytes of slots, 16 to 512 of them
SEND_BATCH = 256  # datagrams per sendmmsg when unpaced
# A sender's stream has ended once one of its last chunks came, its last quarter but at most
# TAIL of them: paced datagrams of one stream arrive in order, so what it still lacks then
# was lost, not in flight. (Of a stream of a few chunks only the last says so: its first says
# nothing of whether the others were sent yet.)
TAIL = 4
JOINED_LATE = 64  # a stream first seen at this sequence number or beyond was joined late
# The default pacing burst: how late a wake-up can be and still be caught up (a busy host
# wakes a sleeper milliseconds late), at most BURST_FRAMES, which a shaper's queue (1000
# packets in htb's and netem's default) takes whole.
BURST_SECONDS = 0.02
BURST_FRAMES = 256
BATCH_SECONDS = 0.005  # a paced sender hands the kernel this much traffic per call
# While datagrams keep coming, a collect waits this long before it reads, so one read takes a
# batch; a wait that found nothing sleeps in poll until something comes.
NAP_SECONDS = 0.001
NOWHERE = (-1, -1, -1, -1)  # a sender's progress before any datagram of its
ANNOUNCE_SECONDS = 0.02  # how often a waiting worker says where it is (`collect(announce=)`)
# A paced sender reads its socket this often: at 100 Mbit/s a read then takes ~80 datagrams,
# and even at 1 Gbit/s what comes meanwhile (2 MB of buffer) fits the default receive buffer.
READ_INTERVAL = 0.01

Key = tuple[int, int, int]  # (kind, step, bucket)
# The kinds that make up a call's phases, in the order a call goes through them: where a sender
# got to (its datagrams and its PROGRESS words) is judged by (step, bucket, kind).
PHASES = (Kind.GRADIENT, Kind.PARAMETER, Kind.CONTROL, Kind.REPAIR)


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
    """What `collect` got for one key. `arrived`: per expected sender, a bool per chunk: it
    came in time (and fit its sink, if it had one). `chunks`: the first copy of each chunk of
    the senders that had no sink. How many datagrams of this kind came late for keys closed
    before (a deadline that was too short) since the key was opened, in all and per sender;
    when the last in-time chunk came (time.monotonic(); None if none did). Per sender that sent
    any in time: when its first and its last chunk of the key came; per sender none of whose
    chunks came but that was seen past its part of the key (it sent them: lost): when."""

    chunks: list[Chunk]
    arrived: dict[int, np.ndarray]
    late: int
    last_arrival: float | None
    late_from: dict[int, int] = dataclasses.field(default_factory=dict)
    first_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    last_arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    reached: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def missing(self) -> set[tuple[int, int]]:
        """The expected (sender, index) pairs that did not come in time."""
        return {(sender, index) for sender, came in self.arrived.items()
                for index in np.flatnonzero(~came).tolist()}


class Sink(Protocol):
    """Where one sender's chunks of an opened key are written as they are read. The endpoint
    hands it only chunks of a `numel`-element tensor of `codec` that are new: the right count,
    each chunk's length right, the first copy of each."""

    codec: Codec
    numel: int

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        """Chunks `index` (distinct); row i of `payload` ((k, chunk_numel), the elements as
        same-size integers, a view valid for this call only) holds chunk index[i]; the last
        chunk's row only as far as the tensor goes."""


class Landing:
    """A `Sink` that copies chunks into tensors: chunk i at element i * chunk_numel of the
    concatenation of `parts` (flat, contiguous, one dtype). With two parts (a shard of the
    result and a small side buffer), a message sent from two tensors lands without a joined
    copy on either side."""

    def __init__(self, parts: Sequence[torch.Tensor], chunk_numel: int) -> None:
        if len({part.dtype for part in parts}) != 1:
            raise ValueError(f"parts: need one dtype, got {[part.dtype for part in parts]}")
        self.codec = codec_of(parts[0].dtype)
        self._n = n = chunk_numel
        # Per part: its elements, where it starts, the chunks [first, end) wholly inside it as
        # rows of a grid, and the chunks it shares with a neighbour or that end it short.
        self._parts: list[tuple[np.ndarray, int, int, int, np.ndarray, list[int]]] = []
        offset = 0
        for part in parts:
            target = bits(part)
            if target.size:
                first, end = -(-offset // n), (offset + target.size) // n
                grid = target[first * n - offset:max(first, end) * n - offset].reshape(-1, n)
                touched = {offset // n, (offset + target.size - 1) // n}
                edges = sorted(chunk for chunk in touched if not first <= chunk < end)
                self._parts.append((target, offset, first, end, grid, edges))
            offset += target.size
        self.numel = offset

    def read(self, index: np.ndarray) -> np.ndarray:
        """Chunks `index` as they stand now, as rows of same-size integers ((k, chunk_numel));
        what lies past the last part reads as zeros. The inverse of `land`."""
        n = self._n
        rows = np.zeros((len(index), n), dtype=self._parts[0][0].dtype if self._parts
                        else np.int32)
        for target, offset, first, end, grid, edges in self._parts:
            inside = (index >= first) & (index < end)
            if inside.any():
                rows[inside] = grid[index[inside] - first]
            for edge in edges:
                for row in np.flatnonzero(index == edge).tolist():
                    lo, hi = max(edge * n, offset), min((edge + 1) * n, offset + target.size)
                    rows[row, lo - edge * n:hi - edge * n] = target[lo - offset:hi - offset]
        return rows

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        n = self._n
        for target, offset, first, end, grid, edges in self._parts:
            inside = (index >= first) & (index < end)
            if inside.any():
                grid[index[inside] - first] = payload[inside]
            for edge in edges:
                rows = np.flatnonzero(index == edge)
                if rows.size:
                    lo, hi = max(edge * n, offset), min((edge + 1) * n, offset + target.size)
                    target[lo - offset:hi - offset] = payload[rows[0], lo - edge * n:hi - edge * n]


def chunk_count(numel: int, chunk_numel: int) -> int:
    """Chunks of a `numel`-element tensor (an empty one still travels as one empty chunk)."""
    return max(1, math.ceil(numel / chunk_numel))


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


@dataclass
class _Batch:
    """Datagrams that passed the header checks: row i of `rows` holds datagram i from its
    header on, row i of `headers` its header (NATIVE_HEADER_DTYPE), `arrival` when each was
    read."""

    rows: np.ndarray  # (k, stride) uint8
    headers: np.ndarray
    arrival: np.ndarray  # float64, time.monotonic()

    def __getitem__(self, field: str) -> np.ndarray:
        return self.headers[field]

    def take(self, which: np.ndarray) -> _Batch:
        """The datagrams `which` picks (a bool mask or indexes), rows copied."""
        return _Batch(self.rows[which], self.headers[which], self.arrival[which])

    def __len__(self) -> int:
        return len(self.headers)


def _increasing(values: np.ndarray) -> bool:
    """Each value above the one before it: a stream's run in order, the common case."""
    return len(values) < 2 or bool((values[1:] > values[:-1]).all())


def _first_copies(values: np.ndarray) -> np.ndarray:
    """A bool per element: no element before it has its value."""
    if _increasing(values):
        return np.ones(len(values), dtype=bool)
    first = np.zeros(len(values), dtype=bool)
    first[np.unique(values, return_index=True)[1]] = True
    return first


class _Stream:
    """The sequence numbers one sender incarnation's stream delivered: the highest, and which
    of the `window` up to it came (a ring: number s in slot s % window). Anything already seen
    or older than the window is a replay. `step`: the furthest step it delivered."""

    __slots__ = ("base", "highest", "incarnation", "received", "ring", "step", "window")

    def __init__(self, incarnation: int, first: int, window: int, step: int) -> None:
        self.incarnation = incarnation
        self.window = window
        self.step = step
        # Streams start at 0; one first seen at JOINED_LATE or beyond was joined late (this
        # endpoint restarted while its peers went on), and counting from 0 would call everything
        # before it lost. (A fresh stream whose first JOINED_LATE datagrams were all lost is
        # counted from its first arrival instead: at most that many uncounted.)
        self.base = first if first >= JOINED_LATE else 0
        self.highest = first  # the first datagram, which made the stream, is received
        self.ring = np.zeros(window, dtype=bool)
        self.ring[first % window] = True
        self.received = 1

    def accept(self, seqs: np.ndarray) -> np.ndarray:
        """Which of `seqs` (uint64, in arrival order) are new; the stream takes them in."""
        window, highest = self.window, np.uint64(self.highest)
        if seqs[0] > highest and _increasing(seqs):  # a run beyond everything seen
            took = np.ones(len(seqs), dtype=bool)
        else:
            before = np.empty_like(seqs)  # the highest seen before each one
            before[0] = highest
            before[1:] = seqs[:-1]
            np.maximum.accumulate(before, out=before)
            new = seqs > before
            # below the highest: new only within the window, from the stream's start on, not
            # seen before this batch (in the ring), and not earlier in it
            below = ~new & (before - seqs < window) & (seqs >= self.base) & _first_copies(seqs)
            below[below] = ~((seqs[below] <= highest) & self.ring[seqs[below] % window])
            took = new | below
        top = max(self.highest, int(seqs.max()))
        advance = top - self.highest
        if advance >= window:
            self.ring[:] = False
        elif advance:
            start = (self.highest + 1) % window
            self.ring[start:start + advance] = False
            self.ring[:max(0, start + advance - window)] = False
        self.ring[seqs[took & (np.uint64(top) - seqs < window)] % window] = True
        self.highest = top
        self.received += int(took.sum())
        return took

    @property
    def lost(self) -> int:
        return self.highest + 1 - self.base - self.received


class _Open:
    """An opened key: where each sender's chunks go, and what came so far."""

    def __init__(self, expected: Mapping[int, int], sinks: Mapping[int, Sink],
                 late_before: Counter[int], present: Mapping[int, np.ndarray]) -> None:
        self.arrived = {sender: np.zeros(count, dtype=bool) for sender, count in expected.items()}
        for sender, here in present.items():  # chunks in hand already: not owed
            self.arrived[sender] |= here
        # per sender, how many of its chunks have not come
        self.owed = {sender: count - int(self.arrived[sender].sum())
                     for sender, count in expected.items()}
        self.sinks = dict(sinks)
        self.chunks: dict[tuple[int, int], Chunk] = {}  # of senders without a sink
        self.first: dict[int, float] = {}  # per sender, when its first chunk of the key came
        self.last: dict[int, float] = {}  # per sender, when its latest chunk of the key came
        self.ended: set[int] = set()  # senders whose stream reached its tail
        # per sender without a chunk yet, when it was first seen past its part of the key:
        # it sent it, so what has not come was lost (or is still on its way)
        self.reached: dict[int, float] = {}
        self.newest: float | None = None  # when the newest chunk came
        self.late_before = late_before  # datagrams of this kind late per sender, when opened

    def deliver(self, sender: int, batch: _Batch, chunk_numel: Mapping[int, int]) -> None:
        """Take in a batch of this key's datagrams from `sender`: into its sink, or kept."""
        sink = self.sinks.get(sender)
        if sink is None:
            fit = np.ones(len(batch), dtype=bool)
            self._keep(sender, batch)
        else:
            fit = self._land(sender, sink, batch, chunk_numel[sink.codec])
            if not fit.all():
                batch = batch.take(fit)
        if not len(batch):
            return
        self.first.setdefault(sender, float(batch.arrival[0]))
        self.last[sender] = float(batch.arrival[-1])
        self.newest = max(self.newest or -math.inf, float(batch.arrival[-1]))
        chunks = batch["chunks"].astype(np.int64)
        if (chunks - batch["chunk"] <= np.clip(chunks // 4, 1, TAIL)).any():
            self.ended.add(sender)

    def _land(self, sender: int, sink: Sink, batch: _Batch, n: int) -> np.ndarray:
        """Hand the sink the new chunks that fit it; which datagrams fit."""
        itemsize = ITEMSIZE[sink.codec]
        count = chunk_count(sink.numel, n)
        chunk = batch["chunk"]
        expected = np.where(chunk == count - 1, sink.numel - (count - 1) * n, n)
        fit = ((batch["codec"] == sink.codec) & (batch["chunks"] == count)
               & (batch["payload_len"] == expected * itemsize))
        index = chunk[fit].astype(np.int64)
        arrived = self.arrived[sender]
        new = ~arrived[index] & _first_copies(index)
        if new.any():
            rows = batch.rows[np.flatnonzero(fit)[new], HEADER_SIZE:HEADER_SIZE + n * itemsize]
            sink.land(index[new], rows.view(bits_dtype(itemsize)))
            arrived[index[new]] = True
            self.owed[sender] -= int(new.sum())
        return fit

    def _keep(self, sender: int, batch: _Batch) -> None:
        """Keep the first copy of each chunk of a sender without a sink (tests, small keys)."""
        arrived = self.arrived.get(sender)
        for row, index, count, codec, size, arrival in zip(
            batch.rows, batch["chunk"].tolist(), batch["chunks"].tolist(),
            batch["codec"].tolist(), batch["payload_len"].tolist(), batch.arrival.tolist(),
            strict=True,
        ):
            if (sender, index) in self.chunks:
                continue
            payload = memoryview(bytearray(row[HEADER_SIZE:HEADER_SIZE + size]))
            self.chunks[sender, index] = Chunk(sender, index, count, Codec(codec), payload, arrival)
            if arrived is not None and index < len(arrived):
                arrived[index] = True
                self.owed[sender] -= 1


class DatagramEndpoint:
    """This worker's UDP socket: sends tensors to peers as chunks, collects chunks by key.

    `mtu` sizes the chunks (no datagram is larger than one IP packet of `mtu` bytes); `rate`
    (bits/s of Ethernet frames, what a qdisc counts) paces sending, None sends as fast as the
    socket takes it. `rcvbuf`/`sndbuf` are asked of the kernel (beyond rmem_max when root);
    `rcvbuf_bytes`/`sndbuf_bytes` say what it granted (Linux doubles the request for its own
    bookkeeping). Keys more than `history_steps` below the newest collected step are closed.
    With `key` (the run's secret, `testbed.transport.auth`), every datagram carries a MAC and
    only those whose MAC proves the key are taken; every worker of a run must have the same
    key, or none.
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
        key: bytes | None = None,
    ) -> None:
        mmsg_calls()  # a clear TransportError here where the C library lacks them
        ipv6 = ":" in address[0]
        self.rank, self.run_id, self.mtu, self._ipv6 = rank, run_id, mtu, ipv6
        self._mac = None if key is None else DatagramMac(key)
        self.trailer = 0 if key is None else MAC_SIZE  # MAC bytes after each payload
        self.capacity = payload_capacity(mtu, ipv6=ipv6, trailer=self.trailer)
        self._full = {codec: full_payload(self.capacity, codec.itemsize) for codec in Codec}
        self._chunk_numel = {codec: full // codec.itemsize for codec, full in self._full.items()}
        self.incarnation = secrets.randbits(32)
        self.replay_window, self.history_steps = replay_window, history_steps
        self._frame_overhead = ETHERNET_HEADER + (IPV6_HEADER if ipv6 else IPV4_HEADER) + UDP_HEADER
        self._bucket = None
        self._send_batch = SEND_BATCH
        if rate is not None:
            frame = HEADER_SIZE + self.capacity + self.trailer + self._frame_overhead
            burst = burst or max(4 * frame, min(int(rate / 8 * BURST_SECONDS),
                                                BURST_FRAMES * frame))
            self._bucket = TokenBucket(rate, burst, time.monotonic())
            self._send_batch = max(1, min(burst, int(rate / 8 * BATCH_SECONDS)) // frame)
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
        # one more byte: a longer datagram shows as oversize
        slot = HEADER_SIZE + self.capacity + self.trailer + 1
        self._ring = ReceiveRing(max(16, min(512, RING_BYTES // slot)), slot)
        self._flowing = False  # the last read found datagrams
        self._read_due = 0.0  # when a paced sender reads next
        self._peers: dict[int, tuple[str, int]] = {}
        self._names: dict[int, bytes] = {}  # per peer, its C sockaddr
        self._sources = SourceTable(ipv6=ipv6)
        self._next_seq: dict[int, int] = defaultdict(int)
        self._counters: dict[int, DatagramCounters] = defaultdict(DatagramCounters)
        self._streams: dict[int, _Stream] = {}
        self._retired: dict[int, set[int]] = defaultdict(set)
        self._lost_before: Counter[int] = Counter()
        self._rejected: Counter[Reason] = Counter()
        self._receive_errors = 0
        self._rcvbuf_drops = 0
        self._waiting: dict[Key, list[_Batch]] = {}  # datagrams of keys nobody opened yet
        self._open: dict[Key, _Open] = {}
        # per sender, the furthest (step, bucket, kind, done) of its GRADIENT or PARAMETER
        # datagrams (done 0: it was sending that part) or PROGRESS ones (done 1: it had sent
        # it): where it got to
        self._progress: dict[int, tuple[int, int, int, int]] = {}
        self._closed: set[Key] = set()
        self._closed_below = 0  # every step below this is closed
        self._late: Counter[tuple[int, int]] = Counter()  # per (kind, sender)
        for peer, peer_address in (peers or {}).items():
            self.add_peer(peer, peer_address)

    def add_peer(self, rank: int, address: tuple[str, int]) -> None:
        """Where `rank` is (numeric address): where its chunks go, the only address its
        datagrams are taken from, and whose datagrams that are refused are counted against."""
        name = sockaddr(address)
        self._peers[rank] = address
        self._names[rank] = name
        self._sources.add(rank, name)

    def move_peer(self, rank: int, host: str) -> None:
        """`rank` came back at another address, on the same port: from now on its chunks go
        there and its datagrams are taken only from there."""
        self.add_peer(rank, (host, self._peers[rank][1]))

    def chunk_numel(self, codec: Codec = Codec.FLOAT32) -> int:
        """Elements per chunk; chunk i of a tensor holds elements i * chunk_numel onwards."""
        return self._chunk_numel[codec]

    def send_tensor(
        self,
        peer: int,
        kind: Kind,
        step: int,
        bucket: int,
        tensor: torch.Tensor | np.ndarray | Sequence[torch.Tensor],
    ) -> int:
        """Send a tensor to `peer` as chunks (one datagram each), paced; returns the chunk
        count. `send_tensors` for one peer."""
        return self.send_tensors(kind, step, bucket, {peer: tensor})[peer]

    def send_tensors(
        self,
        kind: Kind,
        step: int,
        bucket: int,
        tensors: Mapping[int, torch.Tensor | np.ndarray | Sequence[torch.Tensor]],
        *,
        only: Mapping[int, np.ndarray] | None = None,
    ) -> dict[int, int]:
        """Send each peer its tensor as chunks (one datagram each), paced as one stream: the
        peers' chunks interleaved, each peer's in order, so at any moment each gets its share
        of the rate. (One peer after another instead, a sender that fell behind would send to
        the next peer while another sender still sends to the same one, and together they
        would overrun that peer's link.) A sequence of tensors of one dtype travels as their
        concatenation, read in place. `only`: per peer, the chunks to send (their indexes, in
        order; a repair), not all. Returns each peer's chunk count (of the whole tensor).

        Runs of chunks go to the kernel in one call each (BATCH_SECONDS of traffic). A
        datagram the kernel refuses (ENOBUFS, EPERM from a firewall, an unreachable network)
        is counted in `send_errors` and its sequence number stays used, so the receiver counts
        it lost too: it never reached the wire.
        """
        peers = [peer for peer in tensors if only is None or peer not in only
                 or len(only[peer])]
        if not peers:
            return {}
        runs, keep, counts = [], [], {}
        for peer in peers:
            name = self._names.get(peer)
            if name is None:
                raise TransportError(f"rank {self.rank}: no address for peer {peer}; known: "
                                     f"{sorted(self._peers)}")
            tensor = tensors[peer]
            pieces = [as_bytes(part) for part in (
                [tensor] if isinstance(tensor, torch.Tensor | np.ndarray) else tensor)]
            codecs = {codec for codec, _ in pieces}
            if len(codecs) != 1:
                raise ValueError(f"tensor: parts of one message need one dtype, got {codecs}")
            codec = codecs.pop()
            # the datagrams point into these arrays' memory: `keep` holds it until we return
            arrays = [np.frombuffer(data, dtype=np.uint8) for _, data in pieces]
            keep.append(arrays)
            total = sum(array.size for array in arrays)
            starts = np.arange(0, max(total, 1), self._full[codec])
            counts[peer], chosen = len(starts), None
            if only is not None and peer in only:
                chosen = np.asarray(only[peer], dtype=np.int64)
                starts = starts[chosen]
            ends = np.minimum(starts + self._full[codec], total)
            template = Header(MAGIC, VERSION, kind, codec, self.rank, self.run_id,
                              self.incarnation, 0, step, bucket, 0, 0, 0)
            headers = encode_headers(template, self._next_seq[peer], ends - starts, chosen,
                                     counts[peer])
            trailers = (None if self._mac is None
                        else self._mac.sign(peer, headers, arrays, starts, ends))
            runs.append(Batch(name, headers, [(a.ctypes.data, a.size) for a in arrays], starts,
                              ends, trailers))
        for peer, run in zip(peers, runs, strict=True):
            self._next_seq[peer] += len(run.starts)
        outgoing = Outgoing(runs)
        sizes = np.concatenate(([0], np.cumsum(outgoing.size)))
        fd, n = self._sock.fileno(), len(outgoing)
        done = paid = 0
        sent = np.zeros(n, dtype=bool)  # counted per peer once, however the send ends
        try:
            while done < n:
                end = min(done + self._send_batch, n)
                if self._bucket is not None and end > paid:
                    first = max(done, paid)
                    self._pace(int(sizes[end] - sizes[first])
                               + (end - first) * self._frame_overhead)
                    paid = end
                taken, code = outgoing.send(fd, done, end - done)
                sent[done:done + taken] = True
                done += taken
                if code == errno.EMSGSIZE:
                    peer = peers[outgoing.run[done]]
                    raise TransportError(
                        f"rank {self.rank}: a {outgoing.size[done]}-byte datagram to peer "
                        f"{peer} at {self._peers[peer]} is too large ({os.strerror(code)}); is "
                        f"mtu={self.mtu} right for this path?")
                if code:
                    self._counters[peers[outgoing.run[done]]].send_errors += 1
                    done += 1
        finally:
            whose = outgoing.run[sent]
            datagrams = np.bincount(whose, minlength=len(peers)).tolist()
            nbytes = np.bincount(whose, weights=outgoing.size[sent], minlength=len(peers))
            for peer, count, size in zip(peers, datagrams, nbytes.tolist(), strict=True):
                self._counters[peer].datagrams_sent += count
                self._counters[peer].bytes_sent += int(size)
        return counts

    def open(
        self,
        kind: Kind,
        step: int,
        bucket: int,
        expected: Mapping[int, int],
        *,
        into: Mapping[int, torch.Tensor | Sink] | None = None,
        present: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        """Receive (kind, step, bucket) from now on: `expected` chunks (a count per sender,
        chunks 0 onwards) and, for the senders in `into`, land their chunks as they are read:
        a tensor (flat, contiguous; chunk i at element i * chunk_numel) or any `Sink`. A chunk
        that is not one of such a tensor is left out as if it never came. `present`: per
        sender, a bool per chunk already in hand (a repair's: only the others are owed, and a
        copy of one in hand is not landed again). Datagrams of the key that came before are
        taken in at once. `collect` ends it."""
        key = (int(kind), step, bucket)
        if step < self._closed_below or key in self._closed:
            raise ValueError(f"open: {Kind(kind).name} step {step} bucket {bucket} is closed")
        if key in self._open:
            raise ValueError(f"open: {Kind(kind).name} step {step} bucket {bucket} is open")
        sinks = {}
        for sender, target in (into or {}).items():
            if isinstance(target, torch.Tensor):
                target = Landing([target], self._chunk_numel[codec_of(target.dtype)])
            count = chunk_count(target.numel, self._chunk_numel[target.codec])
            if expected.get(sender) != count:
                raise ValueError(f"open: sender {sender}'s sink takes {count} chunks, "
                                 f"{expected.get(sender)} expected")
            sinks[sender] = target
        late_before = Counter({sender: count for (kind_, sender), count in self._late.items()
                               if kind_ == key[0]})
        state = self._open[key] = _Open(expected, sinks, late_before, present or {})
        now = time.monotonic()
        for sender in expected:
            self._note_reached(state, key, sender, now)
        for batch in self._waiting.pop(key, []):
            for sender in np.unique(batch["sender"]).tolist():
                state.deliver(sender, batch.take(batch["sender"] == sender), self._chunk_numel)

    def collect(
        self,
        kind: Kind,
        step: int,
        bucket: int,
        expected: Mapping[int, int] | None,
        deadline: float,
        *,
        settle: float | None = None,
        into: Mapping[int, torch.Tensor | Sink] | None = None,
        transfer: float | None = None,
        start_by: Mapping[int, float] | None = None,
        announce: bool = False,
    ) -> Collected:
        """Chunks of (kind, step, bucket) until every expected chunk came or time.monotonic()
        passes `deadline`. With `expected` (a chunk count per sender) and `into`, the key is
        opened here (see `open`); with None, it was opened before. The key is closed afterwards:
        later chunks of it are late.

        With `settle`, the wait also ends once every expected sender's stream has ended (one
        of its last TAIL chunks came) and nothing came for `settle` seconds: the rest was lost.
        Under loss that ends a call when the data stops rather than at the deadline, which
        then only bounds the wait for senders that are slow or gone.

        With `transfer`, each sender gets its own limit: `transfer` seconds after its first
        chunk of the key came, or, while none has, until `start_by[sender]` (time.monotonic();
        default `deadline`). The wait ends once no sender that still owes chunks is within its
        limit. So a sender that starts late (it computed longer) is waited for as long as
        `start_by` allows, and its stream as long as a stream takes, whatever its start;
        `deadline` still bounds the whole wait. A sender seen past its part of the key
        (datagrams of a later key, or PROGRESS) sent it: if none of its chunks came, they
        were lost, and it is waited for only `transfer` more (`settle` with the others).

        With `announce`, this worker says where it is (`announce`) to every sender of the key
        as the wait begins and every ANNOUNCE_SECONDS while it lasts: a sender whose whole
        stream to this worker was lost then learns that this worker sent its own, and stops
        waiting for it, however short the streams."""
        key = (int(kind), step, bucket)
        if expected is not None:
            self.open(kind, step, bucket, expected, into=into)
        elif into is not None or key not in self._open:
            raise ValueError(f"collect: {Kind(kind).name} step {step} bucket {bucket} is not "
                             f"open; give `expected` (and `into`) to open it here")
        state = self._open[key]
        started = time.monotonic()
        heard = started  # the next announcement, when announcing
        try:
            self._drain()
            while any(owed > 0 for owed in state.owed.values()):
                now = time.monotonic()
                if announce and now >= heard:
                    self.announce(kind, step, bucket, list(state.owed))
                    heard = now + ANNOUNCE_SECONDS
                limits = self._limits(state, deadline, transfer, start_by or {}, now)
                if not limits:
                    break
                until = max(limits.values())
                if announce:
                    until = min(until, heard)
                if settle is not None and state.ended >= limits.keys():
                    quiet = (started if state.newest is None else state.newest) + settle
                    if quiet <= now:
                        break
                    until = min(until, quiet)
                self._wait(until - now)
        finally:
            self.close_key(kind, step, bucket)
        late_from = {sender: count - state.late_before[sender]
                     for (kind_, sender), count in self._late.items()
                     if kind_ == key[0] and count > state.late_before[sender]}
        return Collected(
            chunks=list(state.chunks.values()),
            arrived=state.arrived,
            late=sum(late_from.values()),
            last_arrival=state.newest,
            late_from=late_from,
            first_arrivals=state.first,
            last_arrivals=state.last,
            reached=state.reached,
        )

    def close_key(self, kind: Kind, step: int, bucket: int) -> None:
        """Stop receiving (kind, step, bucket), opened or not: what comes for it is late."""
        key = (int(kind), step, bucket)
        self._open.pop(key, None)
        self._waiting.pop(key, None)
        self._close(key)

    @staticmethod
    def _limits(state: _Open, deadline: float, transfer: float | None,
                start_by: Mapping[int, float], now: float) -> dict[int, float]:
        """The senders that still owe chunks and are within their limit, with that limit."""
        limits = {}
        for sender, owed in state.owed.items():
            if owed <= 0:
                continue
            limit = deadline
            if transfer is not None:
                first = state.first.get(sender, state.reached.get(sender))
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
            stream = self._streams.get(peer)
            counters.datagrams_lost = self._lost_before[peer] + (stream.lost if stream else 0)
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
        """Read what comes within `timeout` seconds: while datagrams flow, after a nap (one
        read then takes a batch); otherwise as soon as one is there."""
        if timeout <= 0 or self._flowing:
            if timeout > 0:
                time.sleep(min(timeout, NAP_SECONDS))
            self._drain()
        elif self._poll.poll(timeout * 1000):
            self._drain()

    def _drain(self) -> None:
        """Read up to DRAIN_BATCH queued datagrams, a ring's worth per system call. Nothing a
        peer sends makes this raise."""
        ring, fd, total = self._ring, self._sock.fileno(), 0
        while total < DRAIN_BATCH:
            try:
                count = ring.receive(fd)
            except OSError:
                self._receive_errors += 1
                break
            if count:
                self._receive(ring.slots[:count], ring.lengths(count), time.monotonic())
            total += count
            if count < ring.count:
                break
        self._flowing = total > 0

    def _receive(self, rows: np.ndarray, lengths: np.ndarray, now: float) -> None:
        """One batch just read: check it (headers, source addresses, MACs), then sequence,
        count and route each sender's part (streams and first copies are per sender; usually
        a batch holds one). A refused datagram is counted against the peer whose address it
        came from: its header cannot be trusted."""
        names = self._ring.names[:len(rows)]
        headers = headers_of(rows)
        codes = rejections(headers, lengths, self.run_id, capacity=self.capacity,
                           trailer=self.trailer)
        codes[(codes == ACCEPTED) & ~self._sources.registered(headers["sender"], names)] = (
            code_of(Reason.WRONG_SOURCE))
        if self._mac is not None:
            which = np.flatnonzero(codes == ACCEPTED)
            if len(which):
                ends = HEADER_SIZE + headers["payload_len"][which].astype(np.int64)
                codes[which[~self._mac.verify(self.rank, rows, which, ends)]] = (
                    code_of(Reason.BAD_MAC))
        ok = codes == ACCEPTED
        if not ok.all():
            self._reject(names[~ok], codes[~ok])
        if not ok.any():
            return
        batch = _Batch(rows, headers, np.full(len(rows), now))
        if not ok.all():
            batch = batch.take(ok)
        senders = batch["sender"]
        if senders.min() == senders.max():
            self._take(int(senders[0]), batch)
            return
        for sender in np.unique(senders).tolist():
            self._take(sender, batch.take(senders == sender))

    def _take(self, sender: int, batch: _Batch) -> None:
        """Datagrams from one sender, in arrival order: replays dropped (counted), the rest
        counted and routed."""
        took = np.zeros(len(batch), dtype=bool)
        # runs of one incarnation, in order: a new one retires the stream before it
        incarnations, seqs, steps = batch["incarnation"], batch["seq"], batch["step"]
        runs = np.flatnonzero(incarnations[1:] != incarnations[:-1]) + 1
        for first, end in zip([0, *runs.tolist()], [*runs.tolist(), len(batch)], strict=True):
            stream, start = self._streams.get(sender), first
            incarnation = int(incarnations[start])
            if stream is None or stream.incarnation != incarnation:
                if incarnation in self._retired[sender]:
                    continue
                if stream is not None:
                    # A restarted sender goes on from the live step: datagrams of an unknown
                    # incarnation whose step is behind the stream's are a recording of an
                    # earlier one, replayed (with the run's key they still carry a valid MAC),
                    # and retire nothing; the first that is not behind starts the new stream.
                    behind = steps[start:end] < stream.step
                    if behind.all():
                        continue
                    start += int(behind.argmin())
                    self._retired[sender].add(stream.incarnation)
                    self._lost_before[sender] += stream.lost
                stream = self._streams[sender] = _Stream(incarnation, int(seqs[start]),
                                                         self.replay_window, int(steps[start]))
                took[start] = True
                start += 1
            if start < end:
                took[start:end] = stream.accept(seqs[start:end])
            if took[first:end].any():
                stream.step = max(stream.step, int(steps[first:end][took[first:end]].max()))
        kept = int(took.sum())
        if kept < len(batch):
            self._counters[sender].datagrams_replayed += len(batch) - kept
            self._rejected[Reason.REPLAYED] += len(batch) - kept
            batch = batch.take(took)
        if kept:
            counters = self._counters[sender]
            counters.datagrams_received += kept
            counters.bytes_received += (int(batch["payload_len"].sum())
                                        + kept * (HEADER_SIZE + self.trailer))
            progress = batch["kind"] == Kind.PROGRESS
            self._advance(sender, batch, progress)
            if progress.any():  # said, taken in: nothing to route
                batch = batch.take(~progress)
            if len(batch):
                self._route(sender, batch)

    def _advance(self, sender: int, batch: _Batch, progress: np.ndarray) -> None:
        """Where `sender` got to, from its datagrams' keys (a PROGRESS datagram's kind is its
        payload byte); each opened key it is now past or at notes that (`_Open.reached`)."""
        kinds = np.where(progress, batch.rows[:, HEADER_SIZE] if progress.any() else 0,
                         batch["kind"])
        phase = np.isin(kinds, PHASES)
        if not phase.any():
            return
        steps, buckets, kinds = batch["step"][phase], batch["bucket"][phase], kinds[phase]
        done = progress[phase]
        last = np.lexsort((done, kinds, buckets, steps))[-1]
        furthest = (int(steps[last]), int(buckets[last]), int(kinds[last]), int(done[last]))
        if furthest <= self._progress.get(sender, NOWHERE):
            return
        self._progress[sender] = furthest
        now = float(batch.arrival[-1])
        for key, state in self._open.items():
            self._note_reached(state, key, sender, now)

    def _note_reached(self, state: _Open, key: Key, sender: int, now: float) -> None:
        """If `sender` is past its part of `key` (it said so, or sent a later key's), its
        stream has ended, even if the chunks that would say so (its tail) were lost; what
        is still in flight is ahead of that word on the same path. With none of its chunks
        here yet, from now its stream is waited for as if it had begun."""
        if (sender not in state.owed
                or self._progress.get(sender, NOWHERE) < (key[1], key[2], key[0], 1)):
            return
        state.ended.add(sender)
        if sender not in state.first:
            state.reached.setdefault(sender, now)

    def announce(self, kind: Kind, step: int, bucket: int, peers: Collection[int]) -> None:
        """Tell `peers` this worker sent its part of (kind, step, bucket) and now waits for
        theirs: a PROGRESS datagram each (it could be lost too: `collect` says it again)."""
        self.send_tensors(Kind.PROGRESS, step, bucket,
                          dict.fromkeys(peers, np.array([int(kind)], dtype=np.uint8)))

    def _route(self, sender: int, batch: _Batch) -> None:
        """Each datagram to its opened key, to the keys waiting to be opened, or late."""
        rest = np.ones(len(batch), dtype=bool)
        for (kind, step, bucket), state in self._open.items():
            mine = (batch["kind"] == kind) & (batch["step"] == step) & (batch["bucket"] == bucket)
            if mine.all():
                state.deliver(sender, batch, self._chunk_numel)
                return
            if mine.any():
                state.deliver(sender, batch.take(mine), self._chunk_numel)
                rest &= ~mine
        waiting: dict[Key, list[int]] = defaultdict(list)
        for i in np.flatnonzero(rest).tolist():
            key = (int(batch["kind"][i]), int(batch["step"][i]), int(batch["bucket"][i]))
            if key[1] < self._closed_below or key in self._closed:
                self._counters[sender].datagrams_late += 1
                self._late[key[0], sender] += 1
            else:
                waiting[key].append(i)
        for key, rows in waiting.items():
            self._waiting.setdefault(key, []).append(batch.take(np.array(rows)))

    def _reject(self, names: np.ndarray, codes: np.ndarray) -> None:
        """Count refused datagrams, each for its reason (`codes`, `wire.rejections`' codes)
        against the peer at its source address (`names`, their sockaddrs; UNKNOWN_PEER for
        strangers)."""
        owners = self._sources.owners(names)
        # one number per (owner, reason): owners from UNKNOWN_PEER (-1) up, codes below 256
        pairs, counts = np.unique((owners + 1) * 256 + codes, return_counts=True)
        for pair, count in zip(pairs.tolist(), counts.tolist(), strict=True):
            peer, code = pair // 256 - 1, pair % 256
            reason = REASONS[code - 1]
            self._rejected[reason] += count
            counters = self._counters[peer]
            name = f"datagrams_{reason.category}"
            setattr(counters, name, getattr(counters, name) + count)

    def _close(self, key: Key) -> None:
        """Close a key; keys of steps that fell out of the history are closed too, and what
        was waiting in them is late."""
        self._closed.add(key)
        floor = key[1] - self.history_steps
        if floor <= self._closed_below:
            return
        self._closed_below = floor
        self._closed = {k for k in self._closed if k[1] >= floor}
        for old in [k for k in self._waiting if k[1] < floor]:
            for batch in self._waiting.pop(old):
                for sender, count in Counter(batch["sender"].tolist()).items():
                    self._counters[sender].datagrams_late += count
                    self._late[old[0], sender] += count

    # -- sending ----------------------------------------------------------------------------

    def _pace(self, frame_bytes: int) -> None:
        """Wait for pacing tokens, reading the socket meanwhile every READ_INTERVAL: often
        enough that the receive buffer never fills, seldom enough that a read takes a batch."""
        now = time.monotonic()
        until = now + self._bucket.take(frame_bytes, now)
        while True:
            if now >= self._read_due:
                self._drain()
                self._read_due = now + READ_INTERVAL
                now = time.monotonic()
            if now >= until:
                return
            time.sleep(min(until, self._read_due) - now)
            now = time.monotonic()


def _buffer(sock: socket.socket, option: int, force: int, size: int) -> int:
    """Ask for a socket buffer (forced past the sysctl limit if allowed); what was granted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return sock.getsockopt(socket.SOL_SOCKET, option)


def expected_chunks(senders: Collection[int], numel: int, chunk_numel: int) -> dict[int, int]:
    """The chunk count of a `numel`-element tensor, per sender: `collect`'s `expected`."""
    return dict.fromkeys(senders, chunk_count(numel, chunk_numel))
