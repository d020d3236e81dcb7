"""The wire format: every field survives a round trip, every rejection has its reason, no bytes
at all make the decoder raise anything but MalformedDatagram, and the vectorised check of a
batch gives every datagram the reason the decoder gives it (and accepts what it accepts)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.transport.wire import (
    ACCEPTED,
    FRAME_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Codec,
    FrameHeader,
    Header,
    Kind,
    MalformedDatagram,
    Reason,
    chunk_numel,
    code_of,
    decode,
    decode_frame,
    encode,
    encode_frame,
    encode_headers,
    headers_of,
    payload_capacity,
    rejections,
)

RUN = 0xC0FFEE


def header(**changes: int) -> Header:
    fields = dict(magic=MAGIC, version=VERSION, kind=Kind.GRADIENT, codec=Codec.FLOAT32,
                  sender=3, run_id=RUN, incarnation=0xDEADBEEF, seq=2**40 + 5, step=7,
                  bucket=2, chunk=1, chunks=4, payload_len=8)
    return Header(**(fields | changes))


def datagram(payload: bytes = b"\x01" * 8, **changes: int) -> bytes:
    return encode(header(payload_len=len(payload))._replace(**changes), payload)


def test_round_trip_keeps_every_field():
    original = header(kind=Kind.PARAMETER, codec=Codec.BFLOAT16, sender=65535, run_id=2**32 - 1,
                      incarnation=1, seq=2**64 - 1, step=2**32 - 1, bucket=0, chunk=2**32 - 2,
                      chunks=2**32 - 1, payload_len=6)
    raw = encode(original, b"abcdef")
    assert len(raw) == HEADER_SIZE + 6 == 50
    assert decode(raw, 2**32 - 1) == original
    assert raw[HEADER_SIZE:] == b"abcdef"


def test_header_keeps_float32_payloads_aligned():
    assert HEADER_SIZE == 44 and HEADER_SIZE % 4 == 0
    assert FRAME_SIZE == 28


def test_vectorised_headers_equal_struct_packing():
    lengths = np.array([8, 8, 4])
    rows = encode_headers(header(), seq=100, payload_lens=lengths)
    for i, row in enumerate(rows):
        expected = header(chunk=i, chunks=3, seq=100 + i, payload_len=int(lengths[i]))
        assert bytes(row) == HEADER.pack(*expected)


def test_vectorised_headers_name_a_field_that_does_not_fit():
    with pytest.raises(ValueError, match="step: -1"):
        encode_headers(header(step=-1), seq=0, payload_lens=np.array([4]))
    with pytest.raises(ValueError, match="sender: 65536"):
        encode_headers(header(sender=65536), seq=0, payload_lens=np.array([4]))


def test_capacity_leaves_room_for_ip_udp_and_header():
    assert payload_capacity(1500) == 1500 - 20 - 8 - 44
    assert payload_capacity(1500, ipv6=True) == 1500 - 40 - 8 - 44
    assert payload_capacity(65536) == 65535 - 20 - 8 - 44  # loopback: IP length is 16-bit
    assert chunk_numel(1500, Codec.FLOAT32) == (1500 - 72) // 4
    assert chunk_numel(1500, Codec.FLOAT16) == (1500 - 72) // 2
    assert payload_capacity(1500, trailer=16) == 1500 - 72 - 16  # a MAC after the payload
    assert chunk_numel(1500, Codec.FLOAT32, trailer=16) == (1500 - 88) // 4
    with pytest.raises(ValueError, match="mtu: 60"):
        payload_capacity(60)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", Reason.TRUNCATED),
        (datagram()[: HEADER_SIZE - 1], Reason.TRUNCATED),
        (datagram(magic=0x1234), Reason.BAD_MAGIC),
        (datagram(version=VERSION + 1), Reason.BAD_VERSION),
        (datagram(run_id=RUN + 1), Reason.FOREIGN_RUN),
        (datagram(kind=0), Reason.BAD_KIND),
        (datagram(kind=99), Reason.BAD_KIND),
        (datagram(codec=77), Reason.BAD_CODEC),
        (datagram(chunk=4, chunks=4), Reason.BAD_CHUNK),
        (datagram(chunk=0, chunks=0), Reason.BAD_CHUNK),
        (datagram(payload_len=9), Reason.BAD_LENGTH),
        (datagram()[:-1], Reason.BAD_LENGTH),
        (datagram(b"\0" * 6), Reason.BAD_PAYLOAD),  # 6 bytes are not whole float32s
    ],
)
def test_each_rejection_has_its_reason(raw, reason):
    with pytest.raises(MalformedDatagram) as caught:
        decode(raw, RUN)
    assert caught.value.reason is reason


CAPACITY = 16  # payload bytes a receiver takes: 4 float32 values per chunk


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (datagram(b"\0" * 20, chunk=3, chunks=4), Reason.OVERSIZE),  # longer than the MTU
        (datagram(b"\0" * 8, chunk=1, chunks=4), Reason.MTU_MISMATCH),  # not full, not last
        (datagram(b"\0" * 6, codec=Codec.INT8, chunk=0, chunks=2), Reason.MTU_MISMATCH),
        (datagram(b"\0" * 20)[:HEADER_SIZE - 2], Reason.TRUNCATED),
    ],
)
def test_with_a_capacity_chunks_cut_for_another_mtu_are_refused(raw, reason):
    with pytest.raises(MalformedDatagram) as caught:
        decode(raw, RUN, capacity=CAPACITY)
    assert caught.value.reason is reason
    assert decode(datagram(b"\0" * 16, chunk=1, chunks=4), RUN, capacity=CAPACITY).chunk == 1
    assert decode(datagram(b"\0" * 8, chunk=3, chunks=4), RUN, capacity=CAPACITY).chunk == 3


def rows_of(datagrams: list[bytes], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Datagrams as a receive ring holds them: one per row of `stride` bytes (cut to `size`,
    as the kernel cuts what does not fit its slot; the rest of a row is stale bytes), and the
    length of each."""
    stride = -(-size // 64) * 64
    rows = np.frombuffer(np.random.default_rng(0).bytes(len(datagrams) * stride),
                         dtype=np.uint8).reshape(len(datagrams), stride).copy()
    for row, raw in zip(rows, datagrams, strict=True):
        row[:min(len(raw), size)] = np.frombuffer(raw[:size], dtype=np.uint8)
    return rows, np.array([min(len(raw), size) for raw in datagrams])


def _batch_agrees_with_decode(datagrams: list[bytes], capacity: int | None,
                              trailer: int = 0) -> None:
    size = HEADER_SIZE + (capacity if capacity is not None else 64) + trailer + 1
    rows, lengths = rows_of(datagrams, size)
    codes = rejections(headers_of(rows), lengths, RUN, capacity=capacity, trailer=trailer)
    for code, row, length in zip(codes.tolist(), rows, lengths.tolist(), strict=True):
        try:
            decode(row[:length], RUN, capacity=capacity, trailer=trailer)
        except MalformedDatagram as exc:
            assert code == code_of(exc.reason)
        else:
            assert code == ACCEPTED


def test_a_batch_is_checked_as_each_of_its_datagrams_would_be():
    datagrams = [datagram(b"\0" * 16, chunk=i, chunks=4) for i in range(3)]
    datagrams += [datagram(b"\0" * 8, chunk=3, chunks=4), datagram(b"\0" * 8, chunk=1),
                  datagram(run_id=RUN + 1), b"", b"\x54\x42" * 30]
    rows, lengths = rows_of(datagrams, HEADER_SIZE + CAPACITY + 1)
    codes = rejections(headers_of(rows), lengths, RUN, capacity=CAPACITY)
    assert codes.tolist() == [ACCEPTED] * 4 + [code_of(Reason.MTU_MISMATCH),
                                               code_of(Reason.FOREIGN_RUN),
                                               code_of(Reason.TRUNCATED),
                                               code_of(Reason.BAD_VERSION)]
    _batch_agrees_with_decode(datagrams, CAPACITY)
    _batch_agrees_with_decode(datagrams, None)


def test_a_trailer_follows_the_payload_and_is_not_part_of_it():
    with_mac = datagram(b"\0" * 8) + bytes(16)
    assert decode(with_mac, RUN, trailer=16).payload_len == 8
    for raw, reason in [(datagram(b"\0" * 8), Reason.BAD_LENGTH),  # no trailer
                        (with_mac, Reason.BAD_LENGTH)]:  # a trailer where none is expected
        with pytest.raises(MalformedDatagram) as caught:
            decode(raw, RUN, trailer=16 if len(raw) == HEADER_SIZE + 8 else 0)
        assert caught.value.reason is reason
    with pytest.raises(MalformedDatagram) as caught:  # the trailer does not eat the capacity
        decode(datagram(b"\0" * 20, chunk=3) + bytes(16), RUN, capacity=CAPACITY, trailer=16)
    assert caught.value.reason is Reason.OVERSIZE
    _batch_agrees_with_decode([with_mac, datagram(b"\0" * 8)], CAPACITY, trailer=16)


def test_reasons_fall_into_the_per_peer_categories():
    assert {r.category for r in Reason} == {"foreign", "replayed", "malformed"}
    assert Reason.FOREIGN_RUN.category == Reason.BAD_MAGIC.category == "foreign"
    assert Reason.BAD_CHUNK.category == Reason.OVERSIZE.category == "malformed"
    assert Reason.WRONG_SOURCE.category == Reason.BAD_MAC.category == "foreign"


def test_without_a_run_id_any_run_decodes():
    assert decode(datagram(run_id=5)).run_id == 5


def test_frame_round_trip_and_rejections():
    frame = FrameHeader(MAGIC, VERSION, Kind.CONTROL, Codec.INT8, 9, RUN, 4, 1, 2**40)
    assert decode_frame(encode_frame(frame), RUN) == frame
    for bad, reason in [
        (frame._replace(magic=0), Reason.BAD_MAGIC),
        (frame._replace(run_id=1), Reason.FOREIGN_RUN),
        (frame._replace(codec=Codec.FLOAT32, length=6), Reason.BAD_PAYLOAD),
    ]:
        with pytest.raises(MalformedDatagram) as caught:
            decode_frame(encode_frame(bad), RUN)
        assert caught.value.reason is reason
    with pytest.raises(MalformedDatagram, match="truncated"):
        decode_frame(encode_frame(frame)[:-1], RUN)


def _decodes_or_rejects(raw: bytes) -> None:
    try:
        decoded = decode(raw, RUN)
    except MalformedDatagram as exc:
        assert isinstance(exc.reason, Reason)
        return
    assert decoded.payload_len == len(raw) - HEADER_SIZE
    assert decoded.chunk < decoded.chunks
    assert decoded.run_id == RUN


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=3 * HEADER_SIZE))
def test_fuzz_arbitrary_bytes(raw):
    _decodes_or_rejects(raw)


@settings(max_examples=500, deadline=None)
@given(
    payload=st.binary(max_size=64),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
    cut=st.integers(-8, 8),
    fields=st.fixed_dictionaries(
        {},
        optional={
            "kind": st.integers(0, 255),
            "codec": st.integers(0, 65535),
            "chunk": st.integers(0, 2**32 - 1),
            "chunks": st.integers(0, 2**32 - 1),
            "payload_len": st.integers(0, 2**32 - 1),
            "version": st.integers(0, 255),
        },
    ),
)
def test_fuzz_mutated_valid_datagrams(payload, flips, cut, fields):
    _decodes_or_rejects(_mutated(payload, flips, cut, fields))


def _mutated(payload: bytes, flips: list[tuple[int, int]], cut: int,
             fields: dict[str, int]) -> bytes:
    raw = bytearray(HEADER.pack(*header(payload_len=len(payload))._replace(**fields)) + payload)
    for position, mask in flips:
        raw[position % len(raw)] ^= mask
    return bytes(raw[: len(raw) + cut] if cut < 0 else raw + bytes(cut))


_MUTATED = st.builds(
    _mutated,
    payload=st.binary(max_size=24),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
    cut=st.integers(-8, 8),
    fields=st.fixed_dictionaries({}, optional={
        "kind": st.integers(0, 255),
        "codec": st.sampled_from([0, 1, 2, 3, 4, 5, 65535]),
        "chunk": st.integers(0, 5),
        "chunks": st.integers(0, 5),
        "payload_len": st.integers(0, 24),
        "version": st.integers(0, 2),
    }),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=3 * HEADER_SIZE), _MUTATED), min_size=1,
                max_size=24),
       st.sampled_from([None, 8, CAPACITY, 18]), st.sampled_from([0, 16]))
def test_fuzz_batches_are_checked_as_their_datagrams(datagrams, capacity, trailer):
    _batch_agrees_with_decode(datagrams, capacity, trailer)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=FRAME_SIZE, max_size=FRAME_SIZE))
def test_fuzz_frame_headers(raw):
    try:
        decode_frame(raw, RUN)
    except MalformedDatagram as exc:
        assert isinstance(exc.reason, Reason)


def test_header_layout_is_the_documented_one():
    """docs/transport.md's table: offsets of a few fields, read back with plain struct."""
    raw = datagram()
    assert struct.unpack_from("!H", raw, 0)[0] == MAGIC
    assert struct.unpack_from("!I", raw, 8)[0] == RUN
    assert struct.unpack_from("!Q", raw, 16)[0] == 2**40 + 5
    assert struct.unpack_from("!I", raw, 40)[0] == 8
