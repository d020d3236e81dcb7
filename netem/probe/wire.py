"""The probe datagram: what a probe carries, and how what arrived is told apart.

A probe is a fixed header (magic, version, kind, run id, sequence number, send time, check word)
followed by a pad derived from the run id. Probes travel with a zero UDP checksum (the engine
sets SO_NO_CHECK), otherwise the receiving kernel would silently drop every datagram whose
payload netem damaged, and corruption would look like loss. So the check word covers the header
and the pad is compared byte by byte: any flipped bit is detected, vectorised over a whole train
(`decode`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"NPRB"
VERSION = 1
# A warm-up marker opens every train (and resolves the receiver's link-layer address, whose
# request a lossy link may drop: the probes would then wait a second in the neighbour queue).
KIND_PROBE, KIND_END, KIND_WARMUP = 0, 1, 2
# magic, version, kind, reserved, run id, sequence number, send time (ns), check word
HEADER = struct.Struct("!4sBBHIIQQ")
HEADER_DTYPE = np.dtype(
    [
        ("magic", "S4"),
        ("version", "u1"),
        ("kind", "u1"),
        ("reserved", ">u2"),
        ("run", ">u4"),
        ("seq", ">u4"),
        ("sent_ns", ">u8"),
        ("check", ">u8"),
    ]
)
# Odd multipliers: a flipped bit in the sequence number or the send time always changes the
# check word (an odd number times 2**k is never 0 mod 2**64).
_K_SEQ, _K_SENT, _K_ID = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_MASK64 = 2**64 - 1
FRAME_OVERHEAD = 14 + 20 + 8  # Ethernet, IPv4 and UDP headers in front of a probe
# What `decode` says of each datagram.
STATUS_OK, STATUS_PAYLOAD_CORRUPT, STATUS_MALFORMED = 0, 1, 2


class ProbeError(RuntimeError):
    """A probe could not be run (bad namespace, address or size); the message says which."""


def check_word(run: int, kind: int, seq: int, sent_ns: int) -> int:
    """The header's check word (also computed vectorised by `decode`)."""
    return (seq * _K_SEQ + sent_ns * _K_SENT + ((run << 8) | kind) * _K_ID) & _MASK64


def pad(run: int, length: int) -> bytes:
    """The payload after the header: pseudo-random bytes fixed by the run id."""
    return np.random.default_rng(run).integers(0, 256, length, dtype=np.uint8).tobytes()


def encode(run: int, seq: int, sent_ns: int, size: int, kind: int = KIND_PROBE) -> bytes:
    """One probe datagram of `size` bytes (the header plus the run's pad)."""
    if size < HEADER.size:
        raise ProbeError(f"size: a probe needs at least {HEADER.size} bytes, got {size}")
    header = HEADER.pack(
        MAGIC, VERSION, kind, 0, run, seq, sent_ns, check_word(run, kind, seq, sent_ns)
    )
    return header + pad(run, size - HEADER.size)


@dataclass(frozen=True)
class Decoded:
    """Per datagram: status (STATUS_*), kind, sequence number and send time (valid unless
    malformed)."""

    status: np.ndarray
    kind: np.ndarray
    seq: np.ndarray
    sent_ns: np.ndarray


def decode(slots: np.ndarray, lengths: np.ndarray, *, run: int, size: int) -> Decoded:
    """Classify received datagrams, vectorised; never raises on arbitrary bytes.

    `slots` is (n, width) uint8 holding the first `width` bytes of each datagram, `lengths` the
    datagrams' real lengths. A datagram is malformed unless it is exactly `size` bytes long and
    its header (magic, version, kind, run id, check word) is intact; its payload is then compared
    with the run's pad over the bytes kept.
    """
    n, width = slots.shape
    empty = np.zeros(n, dtype=np.int64)
    if width < HEADER.size:
        return Decoded(np.full(n, STATUS_MALFORMED, np.int8), empty, empty, empty)
    header = np.ascontiguousarray(slots[:, : HEADER.size]).view(HEADER_DTYPE).reshape(n)
    seq = header["seq"].astype(np.uint64)
    sent = header["sent_ns"].astype(np.uint64)
    kind = header["kind"].astype(np.uint64)
    ident = (np.uint64(run) << np.uint64(8)) | kind
    with np.errstate(over="ignore"):
        check = seq * np.uint64(_K_SEQ) + sent * np.uint64(_K_SENT) + ident * np.uint64(_K_ID)
    header_ok = (
        (np.asarray(lengths) == size)
        & (header["magic"] == MAGIC)
        & (header["version"] == VERSION)
        & (header["kind"] <= KIND_WARMUP)
        & (header["reserved"] == 0)
        & (header["run"] == run)
        & (header["check"] == check)
    )
    kept = min(width, size) - HEADER.size
    expected = np.frombuffer(pad(run, max(kept, 0)), dtype=np.uint8)
    payload_ok = np.all(slots[:, HEADER.size : HEADER.size + kept] == expected, axis=1)
    status = np.where(
        header_ok, np.where(payload_ok, STATUS_OK, STATUS_PAYLOAD_CORRUPT), STATUS_MALFORMED
    ).astype(np.int8)
    return Decoded(
        status,
        kind.astype(np.int64),
        seq.astype(np.int64),
        sent.view(np.int64),
    )
