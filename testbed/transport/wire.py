"""The wire format: one fixed header in front of every UDP datagram and every TCP message.

Everything is big-endian and every field sits at an offset that is a multiple of its size, so
a payload right after the 44-byte datagram header is 4-byte aligned and can be viewed as float32
without a copy. No torch here: the format is plain bytes, encoded with numpy for a whole tensor's
chunks at once, checked with numpy for a whole batch of received datagrams at once
(`headers_of`, `rejections`), and decoded with `struct` one datagram at a time.

Network input is untrusted: `decode` either returns a header whose every field is consistent
with the datagram's length, or raises `MalformedDatagram` with a `Reason` (never anything else),
so a receive loop can count the reason and go on. `rejections` is its vectorised twin: the
reason `decode` would give each datagram of a batch, so a receive loop names every fault of a
batch (a flood of garbage included) without a Python call per datagram.

With a keyed MAC (`testbed.transport.auth`) every datagram ends in a `trailer` of MAC bytes
after its payload: the header's `payload_len` leaves it out, and the payload a datagram may
carry shrinks by it (`payload_capacity(..., trailer=)`), so datagrams still fit the MTU.

`step` and `bucket` (32 bits each) say which call a datagram or message belongs to. `bucket`
tells apart the calls of one step: lossy and the ring number their calls within a step and the
compressors' exchanges number theirs, all modulo `BUCKETS`; Moshpit packs three things into it,
the phase of a round (2 bits), the round within the step (10 bits) and a digest of the group's
members (20 bits), so a message of another round or another group is never taken for this one
(`testbed.collectives.moshpit`).
"""

from __future__ import annotations

import functools
import struct
from enum import IntEnum, StrEnum
from typing import NamedTuple

import numpy as np

MAGIC = 0x5442  # "TB"
VERSION = 1
IPV4_HEADER = 20
IPV6_HEADER = 40
UDP_HEADER = 8
ETHERNET_HEADER = 14
MAX_IP_PACKET = 65535  # IPv4 total length (and IPv6 payload length) are 16-bit
BUCKETS = 1 << 32  # the header's bucket field (datagrams and frames): calls number modulo this


class Kind(IntEnum):
    """What a datagram or message carries."""

    GRADIENT = 1  # a worker's slice of a shard, to the shard's owner
    PARAMETER = 2  # an owner's fresh shard, broadcast to every worker
    CONTROL = 3  # anything else a collective needs to say (membership, step markers)
    HELLO = 4  # the first TCP message on a connection: who is calling whom
    # A worker's progress: it has sent its part of (step, bucket) of the kind its one payload
    # byte names, and waits for the others' (so they stop waiting for what was lost of it).
    PROGRESS = 5
    # Chunks of a PARAMETER message sent again, as a receiver asked (its CONTROL datagram of
    # the same step and bucket: which chunks it lacks); they keep their chunk numbers.
    REPAIR = 6


class Codec(IntEnum):
    """How the payload's bytes are to be read; the decoder checks the payload length is a
    whole number of elements."""

    BYTES = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT8 = 4

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self]


ITEMSIZE = {Codec.BYTES: 1, Codec.FLOAT32: 4, Codec.FLOAT16: 2, Codec.BFLOAT16: 2, Codec.INT8: 1}
_KINDS = frozenset(int(kind) for kind in Kind)
# Lookup tables over every value of the u8 kind and u16 codec fields, for `rejections`.
_KIND_VALID = np.isin(np.arange(256), list(_KINDS))
_ITEMSIZES = np.zeros(65536, dtype=np.int64)  # 0: no such codec
_ITEMSIZES[list(ITEMSIZE)] = list(ITEMSIZE.values())


class Reason(StrEnum):
    """Why a datagram was dropped. The value is the Prometheus label."""

    TRUNCATED = "truncated"  # shorter than a header
    OVERSIZE = "oversize"  # longer than the receiver's MTU allows (the kernel truncated it)
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    FOREIGN_RUN = "foreign_run"  # a valid header from another run
    BAD_KIND = "bad_kind"
    BAD_CODEC = "bad_codec"
    BAD_CHUNK = "bad_chunk"  # chunk index not below the chunk count
    BAD_LENGTH = "bad_length"  # the payload length field disagrees with the datagram
    BAD_PAYLOAD = "bad_payload"  # not a whole number of the codec's elements
    MTU_MISMATCH = "mtu_mismatch"  # chunked for another MTU: chunk i would not start at i * n
    REPLAYED = "replayed"  # sequence number already seen, or older than the replay window
    # Not the decoder's: a well-formed datagram whose source address is not the one registered
    # for the sender its header names, or whose MAC does not prove the run's key.
    WRONG_SOURCE = "wrong_source"
    BAD_MAC = "bad_mac"

    @property
    def category(self) -> str:
        """`foreign`, `replayed` or `malformed`: the per-peer counter it goes to."""
        if self in _FOREIGN:
            return "foreign"
        if self is Reason.REPLAYED:
            return "replayed"
        return "malformed"


_FOREIGN = frozenset({Reason.BAD_MAGIC, Reason.BAD_VERSION, Reason.FOREIGN_RUN,
                      Reason.WRONG_SOURCE, Reason.BAD_MAC})
# `rejections`' codes (uint8): ACCEPTED, else 1 + the reason's place in REASONS
REASONS = tuple(Reason)
ACCEPTED = 0
_CODES = {reason: place + 1 for place, reason in enumerate(REASONS)}


def code_of(reason: Reason) -> int:
    """The code `rejections` gives a datagram refused for `reason`."""
    return _CODES[reason]


class MalformedDatagram(ValueError):
    """A datagram (or TCP message header) that is not ours or not well formed."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason.value}{': ' + detail if detail else ''}")
        self.reason = reason


# (name, struct code) in wire order; the struct and the numpy dtype both come from this list.
_DATAGRAM_FIELDS = (
    ("magic", "H"),
    ("version", "B"),
    ("kind", "B"),
    ("codec", "H"),
    ("sender", "H"),
    ("run_id", "I"),
    ("incarnation", "I"),  # random per sending endpoint: a restarted worker starts a new stream
    ("seq", "Q"),  # per (sender incarnation, destination), from 0: gaps are losses
    ("step", "I"),
    ("bucket", "I"),
    ("chunk", "I"),
    ("chunks", "I"),
    ("payload_len", "I"),
)
_FRAME_FIELDS = (
    ("magic", "H"),
    ("version", "B"),
    ("kind", "B"),
    ("codec", "H"),
    ("sender", "H"),
    ("run_id", "I"),
    ("step", "I"),
    ("bucket", "I"),
    ("length", "Q"),
)


def _struct(fields: tuple[tuple[str, str], ...]) -> struct.Struct:
    return struct.Struct("!" + "".join(code for _, code in fields))


HEADER = _struct(_DATAGRAM_FIELDS)
HEADER_SIZE = HEADER.size  # 44
_NUMPY_CODES = {"B": ">u1", "H": ">u2", "I": ">u4", "Q": ">u8"}
HEADER_DTYPE = np.dtype([(name, _NUMPY_CODES[code]) for name, code in _DATAGRAM_FIELDS])
NATIVE_HEADER_DTYPE = HEADER_DTYPE.newbyteorder("=")
FRAME = _struct(_FRAME_FIELDS)
FRAME_SIZE = FRAME.size  # 28


class Header(NamedTuple):
    """A datagram header, fields in wire order."""

    magic: int
    version: int
    kind: int
    codec: int
    sender: int
    run_id: int
    incarnation: int
    seq: int
    step: int
    bucket: int
    chunk: int
    chunks: int
    payload_len: int


class FrameHeader(NamedTuple):
    """A TCP message header; `length` payload bytes follow it."""

    magic: int
    version: int
    kind: int
    codec: int
    sender: int
    run_id: int
    step: int
    bucket: int
    length: int


def payload_capacity(mtu: int, *, ipv6: bool = False, trailer: int = 0) -> int:
    """Payload bytes per datagram that fit one IP packet of `mtu` bytes with a `trailer` (a
    MAC) after them, so no datagram is ever fragmented (one lost fragment would lose the whole
    datagram)."""
    ip = IPV6_HEADER if ipv6 else IPV4_HEADER
    capacity = min(mtu, MAX_IP_PACKET) - ip - UDP_HEADER - HEADER_SIZE - trailer
    if capacity < 8:
        raise ValueError(f"mtu: {mtu} leaves {capacity} payload bytes per datagram; needs >= 8")
    return capacity


def chunk_numel(mtu: int, codec: Codec, *, ipv6: bool = False, trailer: int = 0) -> int:
    """Elements per chunk: what a full datagram holds. Chunk i starts at i * chunk_numel."""
    return payload_capacity(mtu, ipv6=ipv6, trailer=trailer) // ITEMSIZE[codec]


def encode(header: Header, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One datagram (tests and single control datagrams; tensors go through `encode_headers`)."""
    return HEADER.pack(*header) + bytes(payload)


def encode_headers(template: Header, seq: int, payload_lens: np.ndarray,
                   index: np.ndarray | None = None, chunks: int | None = None) -> np.ndarray:
    """The headers of a whole tensor's chunks at once, as an (n, HEADER_SIZE) uint8 array:
    `template`'s fields, with chunk = 0..n-1 (or `index`, some chunks of a tensor of `chunks`),
    chunks = n, seq = seq..seq+n-1."""
    n = len(payload_lens)
    headers = np.empty(n, dtype=HEADER_DTYPE)
    for name, value in template._asdict().items():
        if not 0 <= value <= np.iinfo(HEADER_DTYPE[name]).max:
            bits = HEADER_DTYPE[name].itemsize * 8
            raise ValueError(f"{name}: {value} does not fit the header's {bits}-bit field")
        headers[name] = value
    headers["chunk"] = np.arange(n) if index is None else index
    headers["chunks"] = n if chunks is None else chunks
    headers["seq"] = seq + np.arange(n, dtype=np.uint64)
    headers["payload_len"] = payload_lens
    return headers.view(np.uint8).reshape(n, HEADER_SIZE)


def full_payload(capacity: int, itemsize: int) -> int:
    """Payload bytes of a full chunk: the whole elements that `capacity` bytes hold."""
    return capacity // itemsize * itemsize


def decode(datagram: bytes | bytearray | memoryview, run_id: int | None = None, *,
           capacity: int | None = None, trailer: int = 0) -> Header:
    """The header of a whole datagram, checked against its length; raises `MalformedDatagram`.

    With `run_id`, a header of another run is `FOREIGN_RUN`. With `capacity` (the receiver's
    `payload_capacity`), a datagram cut for another MTU is refused: a longer one as `OVERSIZE`,
    one whose chunks would not start at multiples of the receiver's chunk size (a chunk other
    than the last that is not full, or any longer than full) as `MTU_MISMATCH`. `trailer`
    bytes (a MAC, checked elsewhere) follow the payload.
    """
    if capacity is not None and len(datagram) > HEADER_SIZE + capacity + trailer:
        raise MalformedDatagram(Reason.OVERSIZE, f"{len(datagram)} bytes")
    if len(datagram) < HEADER_SIZE:
        raise MalformedDatagram(Reason.TRUNCATED, f"{len(datagram)} bytes")
    header = Header._make(HEADER.unpack_from(datagram))
    _check(header.magic, header.version, header.run_id, run_id, header.kind, header.codec)
    if header.chunk >= header.chunks:
        raise MalformedDatagram(Reason.BAD_CHUNK, f"chunk {header.chunk} of {header.chunks}")
    if header.payload_len != len(datagram) - HEADER_SIZE - trailer:
        raise MalformedDatagram(
            Reason.BAD_LENGTH, f"header says {header.payload_len}, {len(datagram)} bytes came"
        )
    if header.payload_len % ITEMSIZE[header.codec]:
        raise MalformedDatagram(Reason.BAD_PAYLOAD, f"{header.payload_len} bytes")
    if capacity is not None:
        full = full_payload(capacity, ITEMSIZE[header.codec])
        if header.payload_len > full or (
            header.chunk < header.chunks - 1 and header.payload_len != full
        ):
            raise MalformedDatagram(
                Reason.MTU_MISMATCH, f"chunk {header.chunk} of {header.chunks} has "
                f"{header.payload_len} bytes, a full one here {full}")
    return header


def headers_of(rows: np.ndarray) -> np.ndarray:
    """The headers at the start of the rows of a C-contiguous (k, stride) uint8 array (one
    datagram per row), as a structured array of NATIVE_HEADER_DTYPE: one copy of the k
    headers, in this host's byte order, so every field after it is a plain integer view."""
    return rows.view(_row_dtype(rows.shape[1]))[:, 0].astype(NATIVE_HEADER_DTYPE)


@functools.cache
def _row_dtype(stride: int) -> np.dtype:
    """HEADER_DTYPE's fields at the start of a `stride`-byte row."""
    names = HEADER_DTYPE.names
    return np.dtype({
        "names": names,
        "formats": [HEADER_DTYPE.fields[name][0] for name in names],
        "offsets": [HEADER_DTYPE.fields[name][1] for name in names],
        "itemsize": stride,
    })


def rejections(headers: np.ndarray, lengths: np.ndarray, run_id: int | None = None, *,
               capacity: int | None = None, trailer: int = 0) -> np.ndarray:
    """`decode` for a batch: for each datagram (`headers` as `headers_of` gives them, `lengths`
    in bytes received), the code of the reason `decode` would refuse it with (`code_of`), or
    ACCEPTED. Where a datagram is shorter than a header, its row's header bytes are whatever the
    buffer held; it is refused as truncated all the same."""
    itemsize = _ITEMSIZES[headers["codec"]]
    size = np.maximum(itemsize, 1)
    payload, chunk, chunks = headers["payload_len"], headers["chunk"], headers["chunks"]
    # decode's checks in its order: the first that fails names the datagram's reason
    checks = [
        (lengths < HEADER_SIZE, Reason.TRUNCATED),
        (headers["magic"] != MAGIC, Reason.BAD_MAGIC),
        (headers["version"] != VERSION, Reason.BAD_VERSION),
        (~_KIND_VALID[headers["kind"]], Reason.BAD_KIND),
        (itemsize == 0, Reason.BAD_CODEC),
        (chunk >= chunks, Reason.BAD_CHUNK),
        (payload != lengths - HEADER_SIZE - trailer, Reason.BAD_LENGTH),
        (payload % size != 0, Reason.BAD_PAYLOAD),
    ]
    if run_id is not None:
        checks.insert(3, (headers["run_id"] != run_id, Reason.FOREIGN_RUN))
    if capacity is not None:
        full = capacity // size * itemsize
        checks.insert(0, (lengths > HEADER_SIZE + capacity + trailer, Reason.OVERSIZE))
        # chunk < chunks where it counts, so chunks - chunk cannot wrap there
        checks.append(((payload > full) | ((chunks - chunk != 1) & (payload != full)),
                       Reason.MTU_MISMATCH))
    failed = np.stack([check for check, _ in checks], axis=1)  # (k, checks)
    first = failed.argmax(axis=1)  # the first check each datagram fails (0 if none)
    named = np.array([code_of(reason) for _, reason in checks], dtype=np.uint8)
    return np.where(failed[np.arange(len(first)), first], named[first], ACCEPTED).astype(
        np.uint8)


def encode_frame(header: FrameHeader) -> bytes:
    return FRAME.pack(*header)


def decode_frame(data: bytes | bytearray | memoryview, run_id: int | None = None) -> FrameHeader:
    """A TCP message header (exactly FRAME_SIZE bytes); raises `MalformedDatagram`."""
    if len(data) != FRAME_SIZE:
        raise MalformedDatagram(Reason.TRUNCATED, f"{len(data)} bytes")
    header = FrameHeader._make(FRAME.unpack(data))
    _check(header.magic, header.version, header.run_id, run_id, header.kind, header.codec)
    if header.length % ITEMSIZE[header.codec]:
        raise MalformedDatagram(Reason.BAD_PAYLOAD, f"{header.length} bytes")
    return header


def _check(magic: int, version: int, run: int, expected_run: int | None, kind: int,
           codec: int) -> None:
    """The checks datagrams and TCP messages share."""
    if magic != MAGIC:
        raise MalformedDatagram(Reason.BAD_MAGIC, f"{magic:#06x}")
    if version != VERSION:
        raise MalformedDatagram(Reason.BAD_VERSION, f"version {version}, speaking {VERSION}")
    if expected_run is not None and run != expected_run:
        raise MalformedDatagram(Reason.FOREIGN_RUN, f"run {run}, this is run {expected_run}")
    if kind not in _KINDS:
        raise MalformedDatagram(Reason.BAD_KIND, f"kind {kind}")
    if codec not in ITEMSIZE:
        raise MalformedDatagram(Reason.BAD_CODEC, f"codec {codec}")
