"""TCP streams on loopback: a mesh that forms in any order, exact tensors, and errors that say
who waited for whom and for what."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from testbed.collectives.lab import run_concurrently
from testbed.transport import (
    FRAME_SIZE,
    MAGIC,
    VERSION,
    Codec,
    FrameHeader,
    Kind,
    Listener,
    PeerClosed,
    ProtocolError,
    Stream,
    StreamMesh,
    TransportError,
    TransportTimeout,
)
from testbed.transport.auth import NONCE_SIZE, hello_proof
from testbed.transport.tcp import HELLO_TIMEOUT
from testbed.transport.wire import encode_frame

RUN = 31
LOOPBACK = ("127.0.0.1", 0)
WAIT = 10.0
KEY = bytes(range(32))


@pytest.fixture
def mesh() -> Iterator[Callable[..., list[StreamMesh]]]:
    opened: list[StreamMesh] = []

    def build(world: int, congestion: str | None = None,
              key: bytes | None = None) -> list[StreamMesh]:
        listeners = [Listener(LOOPBACK, congestion=congestion, key=key) for _ in range(world)]
        addresses = {rank: listener.address for rank, listener in enumerate(listeners)}
        meshes = run_concurrently(*[
            lambda rank=rank: StreamMesh.open(rank, listeners[rank], addresses, run_id=RUN,
                                              timeout=WAIT)
            for rank in range(world)
        ])
        for listener in listeners:
            listener.close()
        opened.extend(meshes)
        return meshes

    yield build
    for each in opened:
        each.close()


@pytest.mark.parametrize("key", [None, KEY])
def test_mesh_connects_every_pair(mesh, key):
    meshes = mesh(4, key=key)
    for rank, each in enumerate(meshes):
        assert sorted(each.streams) == [p for p in range(4) if p != rank]
        assert all(each[p].peer == p and each[p].rank == rank for p in each.streams)
    challenge = NONCE_SIZE if key else 0  # the listener's nonce, on the accepted side
    hello = FRAME_SIZE + 2 + (16 if key else 0)
    assert meshes[0][1].counters().bytes_sent == challenge  # rank 1 called rank 0
    assert meshes[0][1].counters().bytes_received == hello
    assert meshes[1][0].counters().bytes_sent == hello
    assert meshes[1][0].counters().bytes_received == challenge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_tensors_arrive_exactly(mesh, dtype):
    a, b = mesh(2)
    tensor = (torch.randn(2_000_000, generator=torch.Generator().manual_seed(3)) * 50).to(dtype)
    out = torch.empty_like(tensor)
    _, received = run_concurrently(
        lambda: a[1].send_tensor(tensor, kind=Kind.GRADIENT, step=4, bucket=2, timeout=WAIT),
        lambda: b[0].recv_tensor(kind=Kind.GRADIENT, step=4, bucket=2, timeout=WAIT, out=out),
    )
    assert received is out and torch.equal(out, tensor)
    sent, got = a[1].counters(), b[0].counters()
    payload = tensor.numel() * tensor.element_size()
    assert sent.bytes_sent == got.bytes_received == 28 + payload
    assert sent.tcp_retransmits == a[1].tcp_info().total_retrans


def test_messages_keep_their_header(mesh):
    a, b = mesh(2)
    a[1].send_message(Kind.CONTROL, 9, 1, b"membership", timeout=WAIT)
    message = b[0].recv_message(timeout=WAIT)
    assert message.payload == b"membership"
    assert (message.header.kind, message.header.step, message.header.bucket) == (Kind.CONTROL, 9, 1)
    assert message.header.sender == 0


def test_receive_timeout_names_rank_peer_address_and_limit(mesh):
    _, b = mesh(2)
    with pytest.raises(TransportTimeout) as caught:
        b[0].recv_message(timeout=0.05)
    text = str(caught.value)
    host, port = b[0].address
    assert f"rank 1: receiving a message header from rank 0 at {host}:{port}" in text
    assert "time limit of 0.05 s" in text and "0 of 28 bytes" in text


def test_connect_to_nobody_times_out_clearly():
    with socket.socket() as unused:
        unused.bind(LOOPBACK)
        address = unused.getsockname()  # bound, never listening: refused
    with pytest.raises(TransportTimeout, match=rf"rank 2: connecting to rank 5 at 127.0.0.1:"
                                               rf"{address[1]}: Connection refused for 0.2 s"):
        Stream.connect(address, rank=2, peer=5, run_id=RUN, timeout=0.2)


def test_accept_turns_away_strangers_and_names_them():
    with Listener(LOOPBACK) as listener, socket.create_connection(listener.address) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(20))
        wrong_run = Stream.connect(listener.address, rank=3, peer=0, run_id=RUN + 1, timeout=WAIT)
        with pytest.raises(TransportTimeout) as caught:
            listener.accept(rank=0, run_id=RUN, timeout=0.3, expect={1, 2})
        wrong_run.close()
    text = str(caught.value)
    assert "waiting on 127.0.0.1" in text and "for ranks [1, 2] to connect" in text
    assert "bad_magic" in text and "foreign_run" in text


def test_a_caller_slow_to_say_hello_holds_up_nobody_and_is_heard_later():
    """On a lossy link a hello can need retransmits seconds apart: the listener hears the
    callers that speak meanwhile, and the slow one when its hello comes."""
    with Listener(LOOPBACK) as listener, socket.create_connection(listener.address) as slow:
        prompt = Stream.connect(listener.address, rank=2, peer=0, run_id=RUN, timeout=WAIT)
        first = listener.accept(rank=0, run_id=RUN, timeout=WAIT, expect={1, 2})
        assert first.peer == 2
        late = Stream(slow, listener.address, rank=1, peer=0, run_id=RUN)
        late.send_message(Kind.HELLO, 0, 0, (0).to_bytes(2, "big"), timeout=WAIT)
        second = listener.accept(rank=0, run_id=RUN, timeout=WAIT, expect={1})
        assert second.peer == 1
        for stream in (prompt, first, second):
            stream.close()


def hello(caller: int, target: int, proof: bytes = b"") -> bytes:
    """A caller's hello as bytes: its header, the rank it meant to reach, any proof."""
    payload = target.to_bytes(2, "big") + proof
    return encode_frame(FrameHeader(MAGIC, VERSION, Kind.HELLO, Codec.BYTES, caller, RUN, 0, 0,
                                    len(payload))) + payload


@pytest.mark.parametrize("key", [None, KEY])
def test_half_a_hello_holds_up_no_other_caller(key):
    """A caller that sent half its hello (and then nothing) is waiting on the listener when a
    real caller comes: the real one is accepted at once, the half one stays unheard. No sleep:
    the half caller's bytes are in before the real caller connects, and accept's own time
    limit bounds the wait."""
    with Listener(LOOPBACK, key=key) as listener, socket.create_connection(
            listener.address) as half:
        half.sendall(hello(1, 0)[:FRAME_SIZE // 2])
        started = time.monotonic()
        accepted, caller = run_concurrently(
            lambda: listener.accept(rank=0, run_id=RUN, timeout=WAIT),
            lambda: Stream.connect(listener.address, rank=2, peer=0, run_id=RUN, timeout=WAIT,
                                   key=key),
        )
        took = time.monotonic() - started
        assert accepted.peer == 2 and took < WAIT < HELLO_TIMEOUT
        with pytest.raises(TransportTimeout, match=r"connected, no whole hello yet: "
                                                   r"127\.0\.0\.1:\d+ \(14 bytes of its hello\)"):
            listener.accept(rank=0, run_id=RUN, timeout=0.2)
        accepted.close()
        caller.close()


def test_a_hello_that_does_not_prove_the_key_is_turned_away_and_named():
    """A keyed listener: a caller with another key, one with none, and one that replays a
    proof made for another connection's nonce (a passive observer's best try) are all turned
    away, each named; a caller with the key is accepted."""
    replayed_proof = hello_proof(KEY, bytes(NONCE_SIZE), RUN, 3, 0)

    def replaying() -> None:
        with socket.create_connection(listener.address) as observer:
            observer.settimeout(WAIT)
            assert len(observer.recv(NONCE_SIZE, socket.MSG_WAITALL)) == NONCE_SIZE
            observer.sendall(hello(3, 0, replayed_proof))
            observer.recv(1)  # until the listener closes it

    with Listener(LOOPBACK, key=KEY) as listener:
        with pytest.raises(TransportTimeout) as caught:
            run_concurrently(
                lambda: listener.accept(rank=0, run_id=RUN, timeout=3.0),
                lambda: Stream.connect(listener.address, rank=1, peer=0, run_id=RUN,
                                       timeout=WAIT, key=bytes(32)),
                lambda: Stream.connect(listener.address, rank=2, peer=0, run_id=RUN,
                                       timeout=WAIT),
                replaying,
            )
        good = run_concurrently(
            lambda: listener.accept(rank=0, run_id=RUN, timeout=WAIT),
            lambda: Stream.connect(listener.address, rank=4, peer=0, run_id=RUN, timeout=WAIT,
                                   key=KEY),
        )
        assert good[0].peer == 4
        for stream in good:
            stream.close()
    text = str(caught.value)
    assert "rank 1's hello does not prove the run's key" in text
    assert "rank 2 has no key; this run's listener wants proof of one" in text
    assert "rank 3's hello does not prove the run's key" in text


def test_a_keyed_caller_to_a_listener_without_the_key_says_so():
    with Listener(LOOPBACK) as listener:  # it sends no challenge
        with pytest.raises(TransportTimeout, match=r"receiving the listener's challenge from "
                                                   r"rank 0 .* does that listener have the "
                                                   r"run's key\?"):
            Stream.connect(listener.address, rank=1, peer=0, run_id=RUN, timeout=0.3, key=KEY)
        with socket.create_connection(listener.address) as caller:
            caller.sendall(hello(1, 0, bytes(16)))
            with pytest.raises(TransportTimeout, match="rank 1 proves a key; this listener has "
                                                       "none"):
                listener.accept(rank=0, run_id=RUN, timeout=0.3)


def test_unexpected_message_is_a_protocol_error(mesh):
    a, b = mesh(2)
    a[1].send_tensor(torch.ones(4), kind=Kind.GRADIENT, step=1, bucket=0, timeout=WAIT)
    with pytest.raises(ProtocolError, match="expected GRADIENT step 2 bucket 0, got GRADIENT "
                                            "step 1 bucket 0; stream closed"):
        b[0].recv_tensor(kind=Kind.GRADIENT, step=2, bucket=0, timeout=WAIT)
    assert b[0].sock.fileno() == -1


def test_a_tensor_that_does_not_fit_out_is_a_protocol_error(mesh):
    a, b = mesh(2)
    a[1].send_tensor(torch.ones(4), kind=Kind.GRADIENT, step=1, bucket=0, timeout=WAIT)
    with pytest.raises(ProtocolError, match=r"4 elements of torch\.float32 came for step 1 "
                                            r"bucket 0, expected 5 of torch\.float32"):
        b[0].recv_tensor(kind=Kind.GRADIENT, step=1, bucket=0, timeout=WAIT,
                         out=torch.empty(5))


def test_peer_closing_is_reported(mesh):
    a, b = mesh(2)
    a[1].close()
    with pytest.raises(PeerClosed, match=r"rank 1: receiving a message header from rank 0 .*"
                                         r"closed the connection after 0 of 28 bytes"):
        b[0].recv_message(timeout=WAIT)


def test_congestion_control_is_chosen_per_socket(mesh):
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    choice = allowed[-1]
    a, b = mesh(2, congestion=choice)
    assert a[1].congestion == b[0].congestion == choice  # connected and accepted ends
    with pytest.raises(TransportError, match=r"'nosuch' is not available.*this kernel has"):
        Listener(LOOPBACK, congestion="nosuch")


def test_tcp_info_reads_the_kernels_figures(mesh):
    a, b = mesh(2)
    run_concurrently(
        lambda: a[1].send_tensor(torch.zeros(100_000), kind=Kind.PARAMETER, step=0, bucket=0,
                                 timeout=WAIT),
        lambda: b[0].recv_tensor(kind=Kind.PARAMETER, step=0, bucket=0, timeout=WAIT),
    )
    info = a[1].tcp_info()
    assert info.state == 1  # TCP_ESTABLISHED
    assert info.bytes_acked >= 400_000 + 28 and info.snd_mss > 0 and info.rtt > 0
