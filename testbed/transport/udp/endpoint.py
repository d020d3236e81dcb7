"""The endpoint: this worker's UDP socket, sending tensors to its peers as paced chunks and
collecting chunks by (kind, step, bucket). The package docstring (`testbed.transport.udp`) says
how it reads, sequences and routes batches."""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import select
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from testbed.transport.auth import MAC_SIZE, DatagramMac
from testbed.transport.counters import DatagramCounters, SocketCounters, socket_drops
from testbed.transport.errors import TransportError
from testbed.transport.mmsg import Batch, Outgoing, ReceiveRing, mmsg_calls, sockaddr
from testbed.transport.sources import SourceTable
from testbed.transport.tensors import as_bytes, codec_of
from testbed.transport.udp.landing import Landing, Sink, chunk_count
from testbed.transport.udp.pacing import TokenBucket, paced
from testbed.transport.udp.progress import Progress
from testbed.transport.udp.reassembly import Collected, Key, OpenKey, ReceivedBatch
from testbed.transport.udp.replay import StreamTable
from testbed.transport.udp.sockets import datagram_socket
from testbed.transport.wire import (
    ACCEPTED,
    ETHERNET_HEADER,
    HEADER_SIZE,
    IPV4_HEADER,
    IPV6_HEADER,
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

DRAIN_BATCH = 1024  # datagrams read per drain, so a flood cannot hold a deadline hostage
RING_BYTES = 1 << 20  # the receive ring: this many bytes of slots, 16 to 512 of them
SEND_BATCH = 256  # datagrams per sendmmsg when unpaced
# While datagrams keep coming, a collect waits this long before it reads, so one read takes a
# batch; a wait that found nothing sleeps in poll until something comes.
NAP_SECONDS = 0.001
ANNOUNCE_SECONDS = 0.02  # how often a waiting worker says where it is (`collect(announce=)`)
# A paced sender reads its socket this often: at 100 Mbit/s a read then takes ~80 datagrams,
# and even at 1 Gbit/s what comes meanwhile (2 MB of buffer) fits the default receive buffer.
READ_INTERVAL = 0.01


class DatagramEndpoint:
    """This worker's UDP socket: sends tensors to peers as chunks, collects chunks by key.

    `mtu` sizes the chunks (no datagram is larger than one IP packet of `mtu` bytes); `rate`
    (bits/s of Ethernet frames, what a qdisc counts) paces sending, None sends as fast as the
    socket takes it. `rcvbuf`/`sndbuf` are asked of the kernel (beyond rmem_max when root);
    `rcvbuf_bytes`/`sndbuf_bytes` say what it granted (Linux doubles the request for its own
    bookkeeping). Keys more than `history_steps` below the newest collected step are closed.
    With `key` (the run's secret, `testbed.transport.auth`), every datagram carries a MAC and
    only those whose MAC proves the key are taken; every worker of a run must have the same
    key, or none. With `ecn` its datagrams are ECN-capable (ECT(0)): a link with netem's `ecn`
    marks them CE instead of dropping them; marks are counted per peer either way
    (`datagrams_ce_marked`), and change nothing else (no congestion response).
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
        ecn: bool = False,
    ) -> None:
        mmsg_calls()  # a clear TransportError here where the C library lacks them
        ipv6 = ":" in address[0]
        self.rank, self.run_id, self.mtu = rank, run_id, mtu
        self._mac = None if key is None else DatagramMac(key)
        self.trailer = 0 if key is None else MAC_SIZE  # MAC bytes after each payload
        self.capacity = payload_capacity(mtu, ipv6=ipv6, trailer=self.trailer)
        self._full = {codec: full_payload(self.capacity, codec.itemsize) for codec in Codec}
        self._chunk_numel = {codec: full // codec.itemsize for codec, full in self._full.items()}
        self.incarnation = secrets.randbits(32)
        self.replay_window, self.history_steps = replay_window, history_steps
        self._frame_overhead = ETHERNET_HEADER + (IPV6_HEADER if ipv6 else IPV4_HEADER) + UDP_HEADER
        self._bucket: TokenBucket | None = None
        self._send_batch = SEND_BATCH
        if rate is not None:
            frame = HEADER_SIZE + self.capacity + self.trailer + self._frame_overhead
            self._bucket, self._send_batch = paced(rate, burst, frame, time.monotonic())
        try:
            self._sock, self.rcvbuf_bytes, self.sndbuf_bytes = datagram_socket(
                address, ipv6=ipv6, rcvbuf=rcvbuf, sndbuf=sndbuf, ecn=ecn)
        except OSError as exc:
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
        self._streams = StreamTable(replay_window)
        self._rejected: Counter[Reason] = Counter()
        self._receive_errors = 0
        self._rcvbuf_drops = 0
        self._waiting: dict[Key, list[ReceivedBatch]] = {}  # datagrams of keys nobody opened yet
        self._open: dict[Key, OpenKey] = {}
        self._progress = Progress()  # where each sender got to
        self._closed: set[Key] = set()
        self._closed_below = 0  # every step below this is closed
        self._joined_at: int | None = None  # first key's step; earlier: sent before it, not late
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
        self._joined_at = step if self._joined_at is None else self._joined_at
        late_before = Counter({sender: count for (kind_, sender), count in self._late.items()
                               if kind_ == key[0]})
        state = self._open[key] = OpenKey(expected, sinks, late_before, present or {})
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
                limits = state.limits(deadline, transfer, start_by or {}, now)
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
        return state.collected(key[0], self._late)

    def close_key(self, kind: Kind, step: int, bucket: int) -> None:
        """Stop receiving (kind, step, bucket), opened or not: what comes for it is late."""
        key = (int(kind), step, bucket)
        self._open.pop(key, None)
        self._waiting.pop(key, None)
        self._close(key)

    def poll(self, timeout: float = 0.0) -> None:
        """Read what is queued, waiting up to `timeout` seconds for something to come."""
        self._wait(timeout)

    def counters(self) -> dict[int, DatagramCounters]:
        """A snapshot per peer (UNKNOWN_PEER: undecodable datagrams from unknown addresses)."""
        snapshot = {}
        for peer in sorted(self._counters):
            counters = dataclasses.replace(self._counters[peer])
            counters.datagrams_lost = self._streams.lost(peer)
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
                self._receive(ring.slots[:count], ring.lengths(count), ring.marked(count),
                              time.monotonic())
            total += count
            if count < ring.count:
                break
        self._flowing = total > 0

    def _receive(self, rows: np.ndarray, lengths: np.ndarray, marked: np.ndarray,
                 now: float) -> None:
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
        batch = ReceivedBatch(rows, headers, np.full(len(rows), now), marked)
        if not ok.all():
            batch = batch.take(ok)
        senders = batch["sender"]
        if senders.min() == senders.max():
            self._take(int(senders[0]), batch)
            return
        for sender in np.unique(senders).tolist():
            self._take(sender, batch.take(senders == sender))

    def _take(self, sender: int, batch: ReceivedBatch) -> None:
        """Datagrams from one sender, in arrival order: replays dropped (counted), the rest
        counted and routed."""
        took = self._streams.accept(sender, batch["incarnation"], batch["seq"], batch["step"])
        kept = int(took.sum())
        if kept < len(batch):
            self._counters[sender].datagrams_replayed += len(batch) - kept
            self._rejected[Reason.REPLAYED] += len(batch) - kept
            batch = batch.take(took)
        if kept:
            counters = self._counters[sender]
            counters.datagrams_received += kept
            if batch.marked is not None:
                counters.datagrams_ce_marked += int(batch.marked.sum())
            counters.bytes_received += (int(batch["payload_len"].sum())
                                        + kept * (HEADER_SIZE + self.trailer))
            progress = batch["kind"] == Kind.PROGRESS
            self._advance(sender, batch, progress)
            if progress.any():  # said, taken in: nothing to route
                batch = batch.take(~progress)
            if len(batch):
                self._route(sender, batch)

    def _advance(self, sender: int, batch: ReceivedBatch, progress: np.ndarray) -> None:
        """Where `sender` got to, from its datagrams' keys (`Progress.advance`); each opened
        key it is now past or at notes that (`OpenKey.reached`)."""
        if not self._progress.advance(sender, batch, progress):
            return
        now = float(batch.arrival[-1])
        for key, state in self._open.items():
            self._note_reached(state, key, sender, now)

    def _note_reached(self, state: OpenKey, key: Key, sender: int, now: float) -> None:
        """If `sender` is past its part of `key` (it said so, or sent a later key's), its
        stream has ended, even if the chunks that would say so (its tail) were lost; what
        is still in flight is ahead of that word on the same path. With none of its chunks
        here yet, from now its stream is waited for as if it had begun."""
        if sender not in state.owed or not self._progress.past(sender, key):
            return
        state.ended.add(sender)
        if sender not in state.first:
            state.reached.setdefault(sender, now)

    def announce(self, kind: Kind, step: int, bucket: int, peers: Collection[int]) -> None:
        """Tell `peers` this worker sent its part of (kind, step, bucket) and now waits for
        theirs: a PROGRESS datagram each (it could be lost too: `collect` says it again)."""
        self.send_tensors(Kind.PROGRESS, step, bucket,
                          dict.fromkeys(peers, np.array([int(kind)], dtype=np.uint8)))

    def _route(self, sender: int, batch: ReceivedBatch) -> None:
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
                if key[1] < (self._joined_at or 0):  # sent before this endpoint took part
                    continue
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
            batches = self._waiting.pop(old)
            if old[1] < (self._joined_at or 0):  # sent before this endpoint took part
                continue
            for batch in batches:
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

