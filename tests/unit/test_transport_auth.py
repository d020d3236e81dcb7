"""The run's key on the datagram path: MACs that cover the receiver, the header and the
payload; keyed endpoints that take only what proves the key (a forged, altered, misdirected or
unsigned datagram from a peer's own address is refused, and cannot retire its stream); key
files that only their owner may read. Every wait is bounded (a marker datagram having come
means everything sent before it from that socket has been read)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.transport import HEADER_SIZE, MAGIC, VERSION, Codec, DatagramEndpoint, Header, Kind
from testbed.transport.auth import (
    KEY_BYTES,
    MAC_SIZE,
    DatagramMac,
    hello_proof,
    read_key,
    write_key,
)
from testbed.transport.wire import encode, payload_capacity

RUN = 91
LOOPBACK = ("127.0.0.1", 0)
WAIT = 10.0
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def crafted(seq: int, *, sender: int = 5, incarnation: int = 1, kind: int = Kind.GRADIENT,
            step: int = 0, payload: bytes = b"\0" * 8) -> bytes:
    return encode(Header(MAGIC, VERSION, kind, Codec.FLOAT32, sender, RUN, incarnation, seq,
                         step, 0, 0, 1, len(payload)), payload)


def signed(datagram: bytes, key: bytes = KEY, receiver: int = 1) -> bytes:
    """`datagram` with the MAC a keyed sender appends for `receiver`."""
    header = np.frombuffer(datagram[:HEADER_SIZE], dtype=np.uint8).reshape(1, HEADER_SIZE)
    payload = np.frombuffer(datagram[HEADER_SIZE:], dtype=np.uint8)
    mac = DatagramMac(key).sign(receiver, header, [payload], np.array([0]),
                                np.array([payload.size]))
    return datagram + mac.tobytes()


def flipped(datagram: bytes, at: int) -> bytes:
    return datagram[:at] + bytes([datagram[at] ^ 0x10]) + datagram[at + 1:]


def wait_for_marker(endpoint: DatagramEndpoint, sender: int = 5) -> None:
    got = endpoint.collect(Kind.CONTROL, 1000, 0, {sender: 1}, time.monotonic() + WAIT)
    assert not got.missing, "the marker datagram never came"


def test_a_mac_covers_the_receiver_and_every_byte_and_ignores_how_parts_are_cut():
    mac = DatagramMac(KEY)
    header = np.arange(HEADER_SIZE, dtype=np.uint8).reshape(1, -1)
    data = np.arange(100, dtype=np.uint8)
    whole = mac.sign(1, header, [data], np.array([10]), np.array([90]))
    cut = mac.sign(1, header, [data[:50], data[50:]], np.array([10]), np.array([90]))
    assert whole.shape == (1, MAC_SIZE) and np.array_equal(whole, cut)
    assert not np.array_equal(whole, mac.sign(2, header, [data], np.array([10]), np.array([90])))
    assert not np.array_equal(whole, DatagramMac(OTHER_KEY).sign(
        1, header, [data], np.array([10]), np.array([90])))
    # verify: every byte of the header, payload or MAC altered is caught, one row each
    datagram = np.concatenate([header[0], data[10:90], whole[0]])
    rows = np.tile(datagram, (len(datagram) + 1, 1))
    rows[np.arange(1, len(rows)), np.arange(len(datagram))] ^= 1
    ends = np.full(len(rows), HEADER_SIZE + 80)
    good = mac.verify(1, rows, np.arange(len(rows)), ends)
    assert good[0] and not good[1:].any()
    assert not mac.verify(2, rows[:1], np.array([0]), ends[:1]).any()


def test_a_short_key_is_refused():
    with pytest.raises(ValueError, match="key: expected at least 16 bytes, got 8"):
        DatagramMac(b"12345678")


def test_a_hello_proof_depends_on_the_nonce_the_run_and_both_ranks():
    nonce = bytes(16)
    proof = hello_proof(KEY, nonce, RUN, 1, 0)
    assert len(proof) == MAC_SIZE
    others = [hello_proof(KEY, b"\1" + nonce[1:], RUN, 1, 0),
              hello_proof(KEY, nonce, RUN + 1, 1, 0), hello_proof(KEY, nonce, RUN, 2, 0),
              hello_proof(KEY, nonce, RUN, 1, 2), hello_proof(OTHER_KEY, nonce, RUN, 1, 0)]
    assert proof not in others and len(set(others)) == len(others)


def test_keyed_endpoints_round_trip_exactly_in_chunks_that_leave_room_for_the_mac():
    tensor = torch.randn(200_000, generator=torch.Generator().manual_seed(5))
    with (
        DatagramEndpoint(1, RUN, LOOPBACK, key=KEY) as receiver,
        DatagramEndpoint(0, RUN, LOOPBACK, key=KEY, peers={1: receiver.address}) as sender,
    ):
        receiver.add_peer(0, sender.address)
        numel = receiver.chunk_numel()
        assert receiver.capacity == payload_capacity(1500) - MAC_SIZE
        assert numel == (payload_capacity(1500) - MAC_SIZE) // 4
        out = torch.empty_like(tensor)
        receiver.open(Kind.GRADIENT, 2, 0, {0: -(-tensor.numel() // numel)}, into={0: out})
        count = sender.send_tensor(1, Kind.GRADIENT, 2, 0, tensor)
        got = receiver.collect(Kind.GRADIENT, 2, 0, None, time.monotonic() + WAIT)
        sent, received = sender.counters()[1], receiver.counters()[0]
    assert not got.missing and torch.equal(out, tensor)
    assert received.datagrams_received == sent.datagrams_sent == count
    assert sent.bytes_sent == received.bytes_received == (count * (HEADER_SIZE + MAC_SIZE)
                                                          + tensor.numel() * 4)
    assert received.datagrams_foreign == received.datagrams_malformed == 0


def test_only_datagrams_that_prove_the_key_are_taken_and_forgeries_retire_nothing():
    """From rank 5's own address (a stranger that forges its source address is no different
    here): unsigned, signed with another key, signed for another receiver, altered after
    signing, and a forged fresh incarnation are refused; rank 5's real stream goes on, and an
    exact copy of a genuine datagram is a replay."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw,
        DatagramEndpoint(1, RUN, LOOPBACK, key=KEY) as receiver,
    ):
        raw.bind(LOOPBACK)
        receiver.add_peer(5, raw.getsockname())
        genuine = signed(crafted(0))
        bad = {
            "malformed": [crafted(1)],  # no MAC: its length says another payload
            "bad_mac": [
                signed(crafted(1), key=OTHER_KEY),
                signed(crafted(1), receiver=2),  # genuine, for another worker
                flipped(signed(crafted(1)), HEADER_SIZE + 3),  # payload altered
                flipped(signed(crafted(1)), 17),  # sequence number altered
                flipped(signed(crafted(1)), len(genuine) - 1),  # MAC altered
                signed(crafted(0, incarnation=9, step=1), key=OTHER_KEY),  # a "restart"
            ],
        }
        for datagram in [genuine, *bad["malformed"], *bad["bad_mac"], genuine]:
            raw.sendto(datagram, receiver.address)
        raw.sendto(signed(crafted(1, kind=Kind.CONTROL, step=1000)), receiver.address)
        wait_for_marker(receiver)
        counters = receiver.counters()[5]
        rejected = receiver.socket_counters().rejected
    assert counters.datagrams_received == 2  # the genuine one and the marker
    assert counters.datagrams_replayed == 1  # the genuine one's copy
    assert counters.datagrams_foreign == len(bad["bad_mac"])
    assert counters.datagrams_malformed == 1 and counters.datagrams_lost == 0
    assert rejected == {"bad_length": 1, "bad_mac": len(bad["bad_mac"]), "replayed": 1}


def test_key_files_are_the_owners_alone(tmp_path: Path):
    path = tmp_path / "run.key"
    write_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    key = read_key(path)
    assert len(key) == KEY_BYTES
    write_key(path)  # a new key replaces the old one
    assert read_key(path) != key
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"run.key: a run's key must be readable by its owner "
                                         r"only \(mode 600\), this file has mode 640"):
        read_key(path)
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 8)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 bytes, this file 8"):
        read_key(short)
