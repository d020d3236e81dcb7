"""UDP endpoints on loopback: exact tensors when nothing is lost, chunks that fit the MTU,
pacing, loss from sequence gaps, late chunks, and datagrams that are dropped and counted
(malformed, foreign, replayed) without ever raising. Datagrams are read in batches; hypothesis
tests check that any stream of datagrams, read in any batches, is counted as a one-at-a-time
model of the rules counts it, and that chunks in any order land where they belong.

Every wait is bounded: a receiver collects until what it expects came or a deadline passes, and
loopback keeps one sender's datagrams in order, so a final marker datagram having arrived means
everything sent before it has been read."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from live import reading, wait_for

from testbed.transport import (
    HEADER_SIZE,
    MAGIC,
    UNKNOWN_PEER,
    VERSION,
    Codec,
    DatagramCounters,
    DatagramEndpoint,
    Header,
    Kind,
    MalformedDatagram,
    TokenBucket,
    TransportError,
    codec_of,
    decode,
    encode,
    expected_chunks,
    mmsg,
    payload_capacity,
    place,
)
from testbed.transport.udp import Landing
from testbed.transport.udp.pacing import BURST_FRAMES, BURST_SECONDS
from testbed.transport.udp.replay import JOINED_LATE

RUN = 77
LOOPBACK = ("127.0.0.1", 0)
WAIT = 10.0  # bound on every wait; a passing test never gets near it


@pytest.fixture
def pair() -> Iterator[tuple[DatagramEndpoint, DatagramEndpoint]]:
    """Rank 0 sends, rank 1 receives; each knows the other."""
    sender = DatagramEndpoint(0, RUN, LOOPBACK)
    receiver = DatagramEndpoint(1, RUN, LOOPBACK, peers={0: sender.address})
    sender.add_peer(1, receiver.address)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture
def raw() -> Iterator[socket.socket]:
    """A plain UDP socket to write hand-made datagrams with."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(LOOPBACK)
    yield sock
    sock.close()


def collect_in_thread(endpoint: DatagramEndpoint, *args, **options) -> tuple[threading.Thread,
                                                                           dict]:
    result: dict = {}

    def run() -> None:
        result["collected"] = endpoint.collect(*args, **options)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def crafted(seq: int, *, sender: int = 5, kind: int = Kind.GRADIENT, step: int = 0,
            bucket: int = 0, chunk: int = 0, chunks: int = 1, run: int = RUN,
            incarnation: int = 1, payload: bytes = b"\0" * 4) -> bytes:
    return encode(Header(MAGIC, VERSION, kind, Codec.FLOAT32, sender, run, incarnation, seq,
                         step, bucket, chunk, chunks, len(payload)), payload)


def wait_for_marker(endpoint: DatagramEndpoint, sender: int = 5, bucket: int = 0) -> None:
    """Collect a CONTROL marker at step 1000 (everything sent before it has been read then)."""
    got = endpoint.collect(Kind.CONTROL, 1000, bucket, {sender: 1}, time.monotonic() + WAIT)
    assert not got.missing, "the marker datagram never came"


def test_million_floats_round_trip_exactly():
    """Paced at 200 Mbit/s so that a receiving thread keeps up even without root's buffers."""
    tensor = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    with (
        DatagramEndpoint(1, RUN, LOOPBACK) as receiver,
        DatagramEndpoint(0, RUN, LOOPBACK, rate=200e6, peers={1: receiver.address}) as sender,
    ):
        receiver.add_peer(0, sender.address)
        numel = receiver.chunk_numel(Codec.FLOAT32)
        expected = expected_chunks([0], tensor.numel(), numel)
        thread, result = collect_in_thread(receiver, Kind.GRADIENT, 3, 1, expected,
                                           time.monotonic() + WAIT)
        sent = sender.send_tensor(1, Kind.GRADIENT, 3, 1, tensor)
        thread.join()
        counters = receiver.counters()[0]
        drops = receiver.socket_counters().rcvbuf_drops
    collected = result["collected"]
    assert sent == expected[0] == len(collected.chunks) and not collected.missing
    out = torch.empty_like(tensor)
    assert place(collected.chunks, out, numel).all()
    assert torch.equal(out, tensor)
    assert counters.datagrams_received == sent
    assert counters.datagrams_lost == counters.datagrams_late == drops == 0


@pytest.mark.parametrize("mtu", [576, 1500, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_chunks_never_exceed_the_capacity(mtu, dtype):
    with (
        DatagramEndpoint(1, RUN, LOOPBACK, mtu=mtu) as receiver,
        DatagramEndpoint(0, RUN, LOOPBACK, mtu=mtu, peers={1: receiver.address}) as sender,
    ):
        receiver.add_peer(0, sender.address)
        tensor = torch.arange(3 * payload_capacity(mtu) + 5).to(dtype)
        count = sender.send_tensor(1, Kind.PARAMETER, 0, 0, tensor)
        numel = receiver.chunk_numel(codec_of(dtype))
        got = receiver.collect(Kind.PARAMETER, 0, 0, expected_chunks([0], tensor.numel(), numel),
                               time.monotonic() + WAIT)
        assert len(got.chunks) == count and not got.missing
        assert max(len(c.payload) for c in got.chunks) <= payload_capacity(mtu)
        assert all(c.count == count for c in got.chunks)
        sent = sender.counters()[1]
        assert sent.bytes_sent <= sent.datagrams_sent * (HEADER_SIZE + payload_capacity(mtu))
        out = torch.empty_like(tensor)
        place(got.chunks, out, numel)
        assert torch.equal(out, tensor)


@pytest.mark.parametrize(
    ("mtu", "reason", "rejected"),
    [(1400, "mtu_mismatch", 2), (9000, "oversize", 3)],  # 1400: the last chunk fits anyway
)
def test_chunks_cut_for_another_mtu_are_rejected(mtu, reason, rejected):
    """Chunk i starts at i * chunk_numel of the receiver's MTU; other chunkings cannot be
    placed, so they are counted and dropped instead of landing in the wrong place."""
    with (
        DatagramEndpoint(1, RUN, LOOPBACK, mtu=1500) as receiver,
        DatagramEndpoint(0, RUN, LOOPBACK, mtu=mtu, peers={1: receiver.address}) as sender,
    ):
        receiver.add_peer(0, sender.address)
        sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.zeros(3 * payload_capacity(mtu) // 4))
        sender.send_tensor(1, Kind.CONTROL, 1000, 0, torch.zeros(1))
        wait_for_marker(receiver, sender=0)
        assert receiver.socket_counters().rejected == {reason: rejected}
        assert receiver.counters()[0].datagrams_malformed == rejected


def test_tensors_for_several_peers_go_out_interleaved_in_proportion(raw):
    """Each peer gets its share of the pacing at any moment: the chunks of a four-chunk and a
    two-chunk tensor alternate in proportion, each peer's in order, each with its own
    sequence numbers."""
    with DatagramEndpoint(0, RUN, LOOPBACK, rate=1e9) as sender:
        numel = sender.chunk_numel()
        sender.add_peer(1, raw.getsockname())
        sender.add_peer(2, raw.getsockname())  # the same socket hears both, in sending order
        counts = sender.send_tensors(Kind.GRADIENT, 0, 0, {1: torch.zeros(4 * numel),
                                                           2: torch.zeros(2 * numel)})
        got = [decode(raw.recv(2048), RUN) for _ in range(6)]
        sent = sender.counters()
    assert counts == {1: 4, 2: 2}
    assert [(h.chunks, h.chunk, h.seq) for h in got] == [
        (4, 0, 0), (2, 0, 0), (4, 1, 1), (4, 2, 2), (2, 1, 1), (4, 3, 3)]
    assert sent[1].datagrams_sent == 4 and sent[2].datagrams_sent == 2
    assert sent[1].bytes_sent == 4 * (HEADER_SIZE + 4 * numel)


def test_token_bucket_pays_debt_with_waiting():
    bucket = TokenBucket(rate=8000, burst=100, now=0.0)  # 1000 bytes/s
    assert bucket.take(100, now=0.0) == 0.0  # the burst goes at once
    assert bucket.take(100, now=0.0) == pytest.approx(0.1)
    assert bucket.take(50, now=0.1) == pytest.approx(0.05)
    assert bucket.take(10, now=10.0) == 0.0  # refilled, but never beyond the burst
    assert bucket.tokens == pytest.approx(90)


@pytest.mark.parametrize(("rate", "burst"), [(20e6, 3000), (100e6, None)])
def test_pacing_limits_the_rate(pair, raw, rate, burst):
    """A lower bound only: the send cannot be faster than the rate allows (minus the burst),
    to one peer or, interleaved, to two."""
    _, receiver = pair
    with DatagramEndpoint(0, RUN, LOOPBACK, rate=rate, burst=burst,
                          peers={1: receiver.address, 2: raw.getsockname()}) as sender:
        start = time.monotonic()
        counts = sender.send_tensors(Kind.GRADIENT, 0, 0, {1: torch.zeros(300_000),
                                                           2: torch.zeros(300_000)})
        elapsed = time.monotonic() - start
        counters = sender.counters()
    frames = sum(counters[peer].bytes_sent + counts[peer] * (14 + 20 + 8) for peer in counts)
    allowed = burst or min(rate / 8 * BURST_SECONDS, BURST_FRAMES * (1500 + 14))  # default
    assert elapsed >= (frames - allowed) * 8 / rate


def test_missing_chunks_are_reported_at_the_deadline(pair):
    sender, receiver = pair
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(10))
    got = receiver.collect(Kind.GRADIENT, 0, 0, {0: 2, 2: 1}, time.monotonic() + 0.05)
    assert got.missing == {(0, 1), (2, 0)}
    assert [(c.sender, c.index) for c in got.chunks] == [(0, 0)]
    assert torch.equal(got.chunks[0].values(), torch.ones(10))
    assert got.last_arrival is not None


def send_chunks(raw: socket.socket, receiver: DatagramEndpoint, indexes, chunks: int) -> None:
    """Chunks of a `chunks`-chunk tensor from rank 5, in order, with full payloads."""
    full = b"\0" * (receiver.chunk_numel() * 4)
    for seq, index in enumerate(indexes):
        raw.sendto(crafted(seq, chunk=index, chunks=chunks, payload=full), receiver.address)


def test_settle_gives_up_on_a_gap_once_the_stream_ended(raw):
    """Chunk 5 of 10 was lost: once the stream's tail came and nothing more for `settle`
    seconds, the rest is lost, and collect returns long before its deadline."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        send_chunks(raw, receiver, [i for i in range(10) if i != 5], chunks=10)
        start = time.monotonic()
        got = receiver.collect(Kind.GRADIENT, 0, 0, {5: 10}, start + WAIT, settle=0.05)
        assert got.missing == {(5, 5)}
        assert time.monotonic() - start < WAIT / 2, "waited out the deadline for a lost chunk"


def test_settle_still_waits_for_a_stream_that_has_not_ended(raw):
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        send_chunks(raw, receiver, range(4), chunks=10)  # the sender is still sending
        start = time.monotonic()
        got = receiver.collect(Kind.GRADIENT, 0, 0, {5: 10}, start + 0.3, settle=0.01)
        assert time.monotonic() - start >= 0.3
        assert got.missing == {(5, index) for index in range(4, 10)}


def test_the_first_chunk_of_a_short_stream_does_not_end_it(raw):
    """Of a 3-chunk stream only the last chunk (or its sender's word) says it ended: its
    first says nothing of whether the others were sent yet (its sender may be unscheduled
    between them), so the wait goes on past `settle`."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        send_chunks(raw, receiver, [0], chunks=3)
        start = time.monotonic()
        got = receiver.collect(Kind.GRADIENT, 0, 0, {5: 3}, start + 0.3, settle=0.01)
        assert time.monotonic() - start >= 0.3
        assert got.missing == {(5, 1), (5, 2)}


def progress(seq: int, kind: Kind = Kind.GRADIENT, step: int = 0, bucket: int = 0) -> bytes:
    """Rank 5 says it sent its part of (kind, step, bucket)."""
    return encode(Header(MAGIC, VERSION, Kind.PROGRESS, Codec.BYTES, 5, RUN, 1, seq, step,
                         bucket, 0, 1, 1), bytes([kind]))


@pytest.mark.parametrize("evidence", ["progress", "a later key"])
def test_a_sender_seen_past_its_stream_is_not_waited_for_as_a_straggler(raw, evidence):
    """Rank 5's only chunk of the key was lost; then it says it sent it (or sends the next
    key): the stream is over, so the wait ends long before the straggler limit."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        said = (progress(0) if evidence == "progress"
                else crafted(0, kind=Kind.PARAMETER))  # (0, 0, GRADIENT) was before it
        raw.sendto(said, receiver.address)
        start = time.monotonic()
        got = receiver.collect(Kind.GRADIENT, 0, 0, {5: 1}, start + WAIT, settle=0.01,
                               transfer=0.05, start_by={5: start + WAIT})
        assert time.monotonic() - start < WAIT / 2, "waited for a stream that was sent"
        assert got.missing == {(5, 0)} and set(got.reached) == {5}
        assert receiver.counters()[5].datagrams_late == 0  # said, not late


def test_a_stream_whose_tail_was_lost_ends_when_its_sender_says_it_is_done(raw):
    """Chunks 6-9 of 10 (the tail that would say the stream ended) were lost: the sender's
    word that it sent its part ends the wait on `settle`, not at the stream's limit."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        receiver.open(Kind.GRADIENT, 0, 0, {5: 10})
        send_chunks(raw, receiver, range(6), chunks=10)
        start = time.monotonic()
        came = reading(
            lambda: receiver.counters().get(5, DatagramCounters()).datagrams_received >= 6,
            receiver)
        wait_for("the first 6 chunks", came, bool, WAIT, every=0)
        raw.sendto(progress(6), receiver.address)  # after the chunks were read
        got = receiver.collect(Kind.GRADIENT, 0, 0, None, start + WAIT, settle=0.01,
                               transfer=WAIT, start_by={5: start + WAIT})
        assert time.monotonic() - start < WAIT / 2, "waited out the limit for a lost tail"
        assert got.missing == {(5, index) for index in range(6, 10)}


def test_a_sender_still_sending_its_stream_is_waited_for(raw):
    """Chunks of the key itself say the sender is sending it, not that it is done."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        send_chunks(raw, receiver, range(4), chunks=10)
        start = time.monotonic()
        got = receiver.collect(Kind.GRADIENT, 0, 0, {5: 10}, start + 0.3, settle=0.01,
                               transfer=1.0, start_by={5: start + 0.3})
        assert time.monotonic() - start >= 0.3 and not got.reached


def test_a_waiting_receiver_says_where_it_is(pair):
    """With `announce`, the receiver tells its senders it sent its part and waits: they see
    it past that key."""
    sender, receiver = pair
    receiver.add_peer(0, sender.address)
    got = receiver.collect(Kind.PARAMETER, 3, 2, {0: 1}, time.monotonic() + 0.05,
                           announce=True)
    assert got.missing == {(0, 0)}
    sender.open(Kind.PARAMETER, 3, 2, {1: 1})
    reached = sender.collect(Kind.PARAMETER, 3, 2, None, time.monotonic() + WAIT,
                             transfer=0.01, start_by={1: time.monotonic() + WAIT})
    assert set(reached.reached) == {1}


def test_chunks_land_in_their_tensor_as_they_come_and_misfits_are_left_out(pair):
    sender, receiver = pair
    numel = receiver.chunk_numel()
    tensor = torch.randn(3 * numel - 5, generator=torch.Generator().manual_seed(3))
    expected = expected_chunks([0], tensor.numel(), numel)
    # Read before the key is opened: chunks of other tensors (one chunk; another dtype) come
    # first, then the real ones. The misfits neither land nor take the real chunks' places.
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(10))
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, tensor.to(torch.bfloat16))
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, tensor)
    receiver.poll(WAIT)  # all six are queued: one read takes them
    out = torch.zeros_like(tensor)
    got = receiver.collect(Kind.GRADIENT, 0, 0, expected, time.monotonic() + 0.2, into={0: out})
    assert not got.missing and got.chunks == []
    assert torch.equal(out, tensor)
    # While waiting: chunks land as they are read, and a misfit (the last chunk, too short)
    # leaves its place empty.
    out.zero_()
    thread, result = collect_in_thread(receiver, Kind.GRADIENT, 1, 0, expected,
                                       time.monotonic() + 0.3, into={0: out})
    sender.send_tensor(1, Kind.GRADIENT, 1, 0, torch.ones(2 * numel + 1))
    thread.join(WAIT)
    assert result["collected"].missing == {(0, 2)}
    assert (out[:2 * numel] == 1).all() and not out[2 * numel:].any()
    assert result["collected"].arrived[0].tolist() == [True, True, False]


def test_a_sinks_short_form_lands_and_ends_the_senders_debt_at_its_length(pair):
    """A landing of five chunks whose last two are optional (`short_count` 3: a broadcast's
    parity, sent only to peers that lose some): a stream of three whole chunks lands and owes
    nothing more, so the collect ends with it, not at its deadline (WAIT: a broken debt would
    hold it there); a stream of another length lands nowhere."""
    sender, receiver = pair
    n = receiver.chunk_numel()
    data, optional = torch.zeros(3 * n), torch.zeros(2 * n)
    sent = torch.randn(3 * n, generator=torch.Generator().manual_seed(5))
    receiver.open(Kind.PARAMETER, 0, 0, {0: 5},
                  into={0: Landing([data, optional], n, short_count=3)})
    sender.send_tensor(1, Kind.PARAMETER, 0, 0, torch.ones(4 * n))  # neither form
    sender.send_tensor(1, Kind.PARAMETER, 0, 0, sent)
    began = time.monotonic()
    got = receiver.collect(Kind.PARAMETER, 0, 0, None, began + WAIT)
    assert time.monotonic() - began < WAIT / 2
    assert got.arrived[0].tolist() == [True, True, True, False, False]
    assert torch.equal(data, sent) and not optional.any()


def test_chunks_after_the_step_closed_are_late(pair):
    sender, receiver = pair
    early = receiver.collect(Kind.GRADIENT, 0, 0, {0: 1}, time.monotonic())  # gives up
    assert early.missing == {(0, 0)}
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(3))  # late for step 0
    sender.send_tensor(1, Kind.GRADIENT, 1, 0, torch.ones(3))
    got = receiver.collect(Kind.GRADIENT, 1, 0, {0: 1}, time.monotonic() + WAIT)
    assert not got.missing and got.late == 1
    counters = receiver.counters()[0]
    assert counters.datagrams_late == 1 and counters.datagrams_received == 2
    with pytest.raises(ValueError, match="step 0 bucket 0 is closed"):
        receiver.collect(Kind.GRADIENT, 0, 0, {}, time.monotonic())


def test_keys_never_collected_expire_as_late(pair):
    sender, receiver = pair
    sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(3))
    receiver.collect(Kind.GRADIENT, 0, 0, {0: 1}, time.monotonic() + WAIT)
    sender.send_tensor(1, Kind.PARAMETER, 1, 0, torch.ones(3))  # nobody collects this one
    sender.send_tensor(1, Kind.GRADIENT, 20, 0, torch.ones(3))
    receiver.collect(Kind.GRADIENT, 20, 0, {0: 1}, time.monotonic() + WAIT)
    assert receiver.counters()[0].datagrams_late == 1  # step 1 fell out of the 8-step history


def test_what_came_for_steps_before_the_first_call_is_not_late(pair):
    """A restarted worker's peers sent to its address before it rejoined: those datagrams are
    of steps before its first call, not late ones of its own calls."""
    sender, receiver = pair
    sender.send_tensor(1, Kind.GRADIENT, 3, 0, torch.ones(3))  # before the receiver took part
    sender.send_tensor(1, Kind.GRADIENT, 20, 0, torch.ones(3))
    receiver.collect(Kind.GRADIENT, 20, 0, {0: 1}, time.monotonic() + WAIT)
    sender.send_tensor(1, Kind.GRADIENT, 4, 0, torch.ones(3))  # still from before it
    sender.send_tensor(1, Kind.GRADIENT, 30, 0, torch.ones(3))
    receiver.collect(Kind.GRADIENT, 30, 0, {0: 1}, time.monotonic() + WAIT)
    counters = receiver.counters()[0]
    assert counters.datagrams_late == 0 and counters.datagrams_received == 4


def test_losses_are_sequence_gaps(raw):
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        for seq in (0, 1, 3, 7):  # 2, 4, 5 and 6 lost
            raw.sendto(crafted(seq, bucket=seq), receiver.address)
        raw.sendto(crafted(8, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        assert receiver.counters()[5].datagrams_lost == 4
        raw.sendto(crafted(5, bucket=5), receiver.address)  # reordered, not lost
        raw.sendto(crafted(9, kind=Kind.CONTROL, step=1000, bucket=1), receiver.address)
        wait_for_marker(receiver, bucket=1)
        counters = receiver.counters()[5]
        assert counters.datagrams_lost == 3 and counters.datagrams_received == 7


def test_a_stream_joined_late_counts_from_where_it_was_joined(raw):
    """A receiver that restarted sees a running stream: what came before it is not loss."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()},
                          replay_window=64) as receiver:
        raw.sendto(crafted(10_000), receiver.address)
        raw.sendto(crafted(10_001, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        counters = receiver.counters()[5]
    assert counters.datagrams_lost == 0 and counters.datagrams_received == 2


def test_replayed_foreign_and_malformed_are_counted_never_raised(raw):
    rng = np.random.default_rng(7)
    garbage = [rng.bytes(int(n)) for n in rng.integers(0, 200, 100)]
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        first = crafted(0)
        bad = [
            first,  # replayed
            crafted(1, run=RUN + 1),  # foreign run
            b"XX" + crafted(1)[2:],  # foreign magic
            crafted(1)[:HEADER_SIZE + 2],  # truncated payload: bad length
            crafted(1, chunk=3, chunks=2),  # malformed
            *garbage,
        ]
        raw.sendto(first, receiver.address)
        for datagram in bad:
            raw.sendto(datagram, receiver.address)
        raw.sendto(crafted(1, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        counters = receiver.counters()[5]
        rejected = receiver.socket_counters().rejected
    assert counters.datagrams_received == 2  # the first copy and the marker
    assert counters.datagrams_replayed == 1
    assert counters.datagrams_foreign >= 2 and counters.datagrams_malformed >= 2
    assert counters.datagrams_foreign + counters.datagrams_malformed == len(bad) - 1
    assert rejected["replayed"] == 1 and rejected["foreign_run"] == 1
    assert sum(rejected.values()) == len(bad)


def test_undecodable_datagrams_from_strangers_count_as_unknown(pair, raw):
    sender, receiver = pair
    raw.sendto(b"hello", receiver.address)
    sender.send_tensor(1, Kind.CONTROL, 1000, 0, torch.ones(1))
    wait_for_marker(receiver, sender=0)
    assert receiver.counters()[UNKNOWN_PEER].datagrams_malformed == 1


def test_an_earlier_incarnation_replayed_cannot_retire_the_current_stream(raw):
    """A restarted sender goes on from the live step; datagrams of an incarnation this receiver
    never saw whose step goes back (recorded before the receiver restarted, replayed) are
    refused as replays, and the current stream goes on."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        raw.sendto(crafted(0, incarnation=2, step=7), receiver.address)
        raw.sendto(crafted(40, incarnation=1, step=6), receiver.address)  # the recording
        raw.sendto(crafted(1, incarnation=2, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        counters = receiver.counters()[5]
    assert counters.datagrams_received == 2 and counters.datagrams_replayed == 1
    assert counters.datagrams_lost == 0


def test_a_restarted_sender_starts_a_new_stream(raw):
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        for seq in range(3):
            raw.sendto(crafted(seq, incarnation=1, bucket=seq), receiver.address)
        raw.sendto(crafted(0, incarnation=2, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        raw.sendto(crafted(3, incarnation=1, step=1), receiver.address)  # the old stream: stale
        raw.sendto(crafted(1, incarnation=2, kind=Kind.CONTROL, step=1000, bucket=1),
                   receiver.address)
        wait_for_marker(receiver, bucket=1)
        counters = receiver.counters()[5]
    assert counters.datagrams_received == 5 and counters.datagrams_replayed == 1
    assert counters.datagrams_lost == 0


def test_a_stranger_naming_a_peer_is_refused_and_cannot_retire_its_stream(raw):
    """A well-formed datagram from an address nobody registered, naming rank 5 with a fresh
    incarnation: refused as wrong_source against UNKNOWN_PEER, before it reaches a stream, so
    rank 5's real stream goes on (no datagram of it counts as replayed)."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger,
        DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver,
    ):
        stranger.bind(LOOPBACK)
        raw.sendto(crafted(0, incarnation=1), receiver.address)
        stranger.sendto(crafted(0, incarnation=2, step=1), receiver.address)
        stranger.sendto(b"\xff" * 30, receiver.address)
        raw.sendto(crafted(1, incarnation=1, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        counters = receiver.counters()
        rejected = receiver.socket_counters().rejected
    assert counters[5].datagrams_received == 2 and counters[5].datagrams_replayed == 0
    assert counters[UNKNOWN_PEER].datagrams_foreign == 1
    assert counters[UNKNOWN_PEER].datagrams_malformed == 1
    assert rejected == {"wrong_source": 1, "truncated": 1}


def test_a_registered_peer_claiming_another_rank_is_refused_against_itself(pair):
    """Rank 0 is registered; its datagrams naming rank 2 (also registered, elsewhere) are
    refused and counted against rank 0, the peer they really came from."""
    sender, receiver = pair
    receiver.add_peer(2, ("127.0.0.1", 9))  # rank 2 is somewhere else
    sender._sock.sendto(crafted(0, sender=2), receiver.address)  # from rank 0's own socket
    sender.send_tensor(1, Kind.CONTROL, 1000, 0, torch.ones(1))
    wait_for_marker(receiver, sender=0)
    counters = receiver.counters()
    assert counters[0].datagrams_foreign == 1 and 2 not in counters
    assert receiver.socket_counters().rejected == {"wrong_source": 1}


def test_place_puts_chunks_in_order_and_skips_misfits(pair):
    sender, receiver = pair
    tensor = torch.arange(10_000, dtype=torch.float32)
    numel = receiver.chunk_numel()
    sender.send_tensor(1, Kind.PARAMETER, 0, 0, tensor)
    sender.send_tensor(1, Kind.PARAMETER, 0, 0, torch.ones(3, dtype=torch.float16))
    got = receiver.collect(Kind.PARAMETER, 0, 0, expected_chunks([0], tensor.numel(), numel),
                           time.monotonic() + WAIT)
    chunks = sorted(got.chunks, key=lambda c: -c.index)  # any order
    keep = [c for c in chunks if c.index != 2]
    out = torch.full_like(tensor, -1)
    fits = place(keep, out, numel)
    assert fits.sum() == len(keep)
    gap = slice(2 * numel, 3 * numel)
    assert torch.equal(out[: 2 * numel], tensor[: 2 * numel])
    assert torch.equal(out[3 * numel:], tensor[3 * numel:])
    assert (out[gap] == -1).all()
    smaller = torch.zeros(numel // 2)
    assert not place(chunks, smaller, numel).any()  # nothing fits


def test_errors_name_the_problem(pair):
    sender, _ = pair
    with pytest.raises(TransportError, match="no address for peer 9"):
        sender.send_tensor(9, Kind.GRADIENT, 0, 0, torch.ones(1))
    with pytest.raises(ValueError, match="float64 has no wire codec"):
        sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="step: 4294967296"):
        sender.send_tensor(1, Kind.GRADIENT, 2**32, 0, torch.ones(1))


def test_a_c_library_without_recvmmsg_is_a_clear_error(monkeypatch):
    """No slower path behind the user's back: without recvmmsg/sendmmsg there is no endpoint,
    and the error says what is missing."""

    class Bare:  # a C library that has neither call
        def __init__(self, *args, **kwargs) -> None:
            pass

    mmsg.mmsg_calls.cache_clear()
    monkeypatch.setattr(mmsg.ctypes, "CDLL", Bare)
    try:
        with pytest.raises(TransportError, match=r"needs recvmmsg\(2\) and sendmmsg\(2\)"):
            DatagramEndpoint(0, RUN, LOOPBACK)
    finally:
        mmsg.mmsg_calls.cache_clear()


def test_buffers_are_granted_and_reported():
    """Linux doubles a request for its bookkeeping; without root it caps it at rmem_max."""
    rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    with DatagramEndpoint(0, RUN, LOOPBACK, rcvbuf=1 << 20) as endpoint:
        counters = endpoint.socket_counters()
    assert counters.rcvbuf_bytes == endpoint.rcvbuf_bytes >= 2 * min(1 << 20, rmem_max)
    assert counters.sndbuf_bytes > 0


class StreamModel:
    """The replay rules one datagram at a time, as docs/transport.md states them: the highest
    sequence number and a bitmap of the `window` below it; a stream first seen at JOINED_LATE
    or beyond counts from there."""

    def __init__(self, incarnation: int, first: int, window: int, step: int) -> None:
        self.incarnation, self.window, self.step = incarnation, window, step
        self.base = first if first >= JOINED_LATE else 0
        self.highest, self.seen, self.received = self.base - 1, 0, 0

    def accept(self, seq: int) -> bool:
        ahead = seq - self.highest
        if ahead > 0:
            full = (1 << self.window) - 1
            self.seen = ((self.seen << ahead) | 1) & full if ahead < self.window else 1
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


def modelled_counts(datagrams: list[tuple[int, bytes]], window: int, capacity: int):
    """Per peer (received, replayed, malformed, foreign, lost), and rejections by reason, of
    (source rank, datagram) pairs: a datagram is refused against the rank at its source, and
    taken only if it names that rank."""
    counts: dict[int, Counter] = defaultdict(Counter)
    reasons: Counter = Counter()
    streams: dict[int, StreamModel] = {}
    retired: dict[int, set[int]] = defaultdict(set)
    for source, raw in datagrams:
        try:
            header = decode(raw, RUN, capacity=capacity)
        except MalformedDatagram as exc:
            counts[source][exc.reason.category] += 1
            reasons[exc.reason.value] += 1
            continue
        if header.sender != source:
            counts[source]["foreign"] += 1
            reasons["wrong_source"] += 1
            continue
        sender, stream = header.sender, streams.get(header.sender)
        if stream is None or stream.incarnation != header.incarnation:
            if header.incarnation in retired[sender] or (
                    stream is not None and header.step < stream.step):
                counts[sender]["replayed"] += 1
                reasons["replayed"] += 1
                continue
            if stream is not None:
                retired[sender].add(stream.incarnation)
                counts[sender]["lost"] += stream.lost
            stream = streams[sender] = StreamModel(header.incarnation, header.seq, window,
                                                   header.step)
        if stream.accept(header.seq):
            counts[sender]["received"] += 1
            stream.step = max(stream.step, header.step)
        else:
            counts[sender]["replayed"] += 1
            reasons["replayed"] += 1
    for sender, stream in streams.items():
        counts[sender]["lost"] += stream.lost
    return counts, reasons


_SEQS = st.one_of(st.integers(0, 90), st.sampled_from([2**63, 2**64 - 2, 2**64 - 1]))
_VALID = st.builds(lambda sender, incarnation, seq, chunk, step: crafted(
    seq, sender=sender, incarnation=incarnation, step=step, bucket=seq % 3, chunk=chunk,
    chunks=2), st.sampled_from([5, 6]), st.sampled_from([1, 2, 3]), _SEQS, st.integers(0, 1),
    st.integers(0, 2))
_BROKEN = st.one_of(
    st.binary(max_size=3 * HEADER_SIZE),
    st.builds(lambda raw, at, mask: raw[:at % len(raw)] + bytes([raw[at % len(raw)] ^ mask])
              + raw[at % len(raw) + 1:], _VALID, st.integers(0, 60), st.integers(1, 255)),
)
# Mostly from the rank the datagram names (5 and 6 send from sockets of their own); any from
# either socket, so a registered peer also claims the other's rank.
_SENT = st.one_of(
    _VALID.map(lambda raw: (decode(raw).sender, raw)),
    st.tuples(st.sampled_from([5, 6]), st.one_of(_VALID, _BROKEN)),
)


@settings(max_examples=120, deadline=None)
@given(datagrams=st.lists(_SENT, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=4))
def test_fuzz_batches_count_as_one_at_a_time(datagrams, cuts):
    """Datagrams from two senders (restarts, replays, reordering, huge sequence numbers, one
    claiming to be the other) and broken ones, read in batches cut anywhere: every counter is
    what the one-at-a-time model gives, and nothing raises."""
    window = 16
    with contextlib.ExitStack() as stack:
        sockets = {}
        for rank in (5, 6, 7):  # 7 sends the marker
            sockets[rank] = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            sockets[rank].bind(LOOPBACK)
        receiver = stack.enter_context(DatagramEndpoint(1, RUN, LOOPBACK, replay_window=window,
                                                        peers={rank: sock.getsockname()
                                                               for rank, sock in sockets.items()}))
        bounds = sorted({0, len(datagrams), *(min(cut, len(datagrams)) for cut in cuts)})
        for start, end in itertools.pairwise(bounds):
            for source, datagram in datagrams[start:end]:
                sockets[source].sendto(datagram, receiver.address)
            receiver.poll()  # loopback delivers within sendto: this read takes the batch
        sockets[7].sendto(crafted(0, sender=7, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver, sender=7)
        counters = receiver.counters()
        rejected = receiver.socket_counters().rejected
    expected, reasons = modelled_counts(datagrams, window, receiver.capacity)
    for peer in (5, 6):
        got = counters.get(peer)
        assert (got.datagrams_received if got else 0) == expected[peer]["received"]
        assert (got.datagrams_replayed if got else 0) == expected[peer]["replayed"]
        assert (got.datagrams_lost if got else 0) == expected[peer]["lost"]
        assert (got.datagrams_malformed if got else 0) == expected[peer]["malformed"]
        assert (got.datagrams_foreign if got else 0) == expected[peer]["foreign"]
    assert rejected == dict(reasons)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 1200), split=st.integers(0, 1200), order=st.randoms(),
       copies=st.integers(1, 2), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fuzz_chunks_land_in_two_parts_in_any_order(numel, split, order, copies, dtype):
    """A message sent from two tensors (as the lossy broadcast sends a shard and its counts)
    whose datagrams come in any order, some twice, lands in two other tensors exactly."""
    split = min(split, numel)
    values = torch.arange(numel).to(dtype)
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as relay,
        DatagramEndpoint(1, RUN, LOOPBACK) as receiver,
        DatagramEndpoint(0, RUN, LOOPBACK) as sender,
    ):
        relay.bind(LOOPBACK)
        sender.add_peer(1, relay.getsockname())
        receiver.add_peer(0, relay.getsockname())  # rank 0's datagrams come from the relay
        count = sender.send_tensor(1, Kind.PARAMETER, 0, 0, (values[:split], values[split:]))
        replay = [relay.recv(2048) for _ in range(count)] * copies
        order.shuffle(replay)
        head = torch.full((split,), -1, dtype=dtype)
        tail = torch.full((numel - split,), -1, dtype=dtype)
        landing = Landing([head, tail], receiver.chunk_numel(codec_of(dtype)))
        receiver.open(Kind.PARAMETER, 0, 0, {0: count}, into={0: landing})
        for datagram in replay:
            relay.sendto(datagram, receiver.address)
        got = receiver.collect(Kind.PARAMETER, 0, 0, None, time.monotonic() + WAIT)
        received = receiver.counters()[0].datagrams_received
    assert not got.missing and got.chunks == []
    assert torch.equal(torch.cat([head, tail]), values)
    assert received == count  # the copies are replays


def test_a_peer_that_moved_is_taken_only_from_its_new_address(raw):
    """A restarted Swarm task comes back at another address, on the same port: after
    `move_peer` its datagrams are taken from there, and the old address is a stranger's."""
    port = raw.getsockname()[1]
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as moved,
        DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver,
    ):
        moved.bind(("127.0.0.2", port))
        moved.sendto(crafted(0, incarnation=1), receiver.address)  # not yet its address
        raw.sendto(crafted(0, incarnation=1, kind=Kind.CONTROL, step=1000), receiver.address)
        wait_for_marker(receiver)
        receiver.move_peer(5, "127.0.0.2")
        raw.sendto(crafted(1, incarnation=1), receiver.address)  # its old address now
        moved.sendto(crafted(0, incarnation=2, kind=Kind.CONTROL, step=1000, bucket=1),
                     receiver.address)
        wait_for_marker(receiver, bucket=1)
        rejected = receiver.socket_counters().rejected
        assert receiver._peers[5] == ("127.0.0.2", port)
    assert rejected == {"wrong_source": 2}


def test_datagrams_marked_ce_are_counted_per_peer(raw):
    """A CE mark (what a link with netem's ecn puts where it would drop an ECN-capable
    packet) is read from each datagram's TOS byte and counted against its sender; unmarked
    ones are not. Here the sender writes the marks itself (UDP lets it set its ECN bits)."""
    with DatagramEndpoint(1, RUN, LOOPBACK, peers={5: raw.getsockname()}) as receiver:
        address = receiver.address
        for seq in range(5):
            raw.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0b11 if seq < 3 else 0b10)
            raw.sendto(crafted(seq), address)
        raw.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0)
        raw.sendto(crafted(5, kind=Kind.CONTROL, step=1000), address)
        wait_for_marker(receiver)
        counters = receiver.counters()[5]
    assert counters.datagrams_received == 6
    assert counters.datagrams_ce_marked == 3


@pytest.mark.parametrize("ecn", [True, False])
def test_an_ecn_endpoint_sends_ecn_capable_datagrams(ecn):
    """With ecn, every datagram leaves ECT(0) (a marking link may mark it); without, Not-ECT."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(LOOPBACK)
        listener.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        listener.settimeout(WAIT)
        with DatagramEndpoint(0, RUN, LOOPBACK, ecn=ecn,
                              peers={1: listener.getsockname()}) as sender:
            sender.send_tensor(1, Kind.GRADIENT, 0, 0, torch.ones(4))
        _, ancillary, _, _ = listener.recvmsg(2048, socket.CMSG_SPACE(1))
    ((level, kind, data),) = ancillary
    assert (level, kind) == (socket.IPPROTO_IP, socket.IP_TOS)
    assert data[0] & 0b11 == (0b10 if ecn else 0)
