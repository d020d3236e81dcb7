"""What Moshpit peers tell each other beyond the vector: a message's phase, round and members'
digest in the frame header's bucket, and the roll call's READY payload."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from enum import IntEnum

import torch

# The header's bucket: phase (2 bits) | round in the step | member digest (testbed.transport.wire).
SEQ_BITS, DIGEST_BITS = 10, 20


class Phase(IntEnum):
    """What a message is for; it sits in the top two bits of the header's bucket."""

    READY = 0
    SCATTER = 1
    GATHER = 2
    STATE = 3  # CONTROL: a joining peer asks for parameters; PARAMETER: the answer


def encode_bucket(phase: Phase, seq: int, digest: int) -> int:
    return phase << (SEQ_BITS + DIGEST_BITS) | seq << DIGEST_BITS | digest


def decode_bucket(bucket: int) -> tuple[Phase, int, int]:
    """(phase, round in the step, members digest) of a bucket."""
    return (Phase(bucket >> (SEQ_BITS + DIGEST_BITS) & 3),
            bucket >> DIGEST_BITS & ((1 << SEQ_BITS) - 1), bucket & ((1 << DIGEST_BITS) - 1))


def members_digest(members: Sequence[int]) -> int:
    """What every later message of a round carries, so a peer with another list of members is
    left out instead of being misread."""
    return zlib.crc32(",".join(map(str, members)).encode()) & ((1 << DIGEST_BITS) - 1)


def ready_payload(weight: float, counted_on: Sequence[int]) -> bytes:
    """A READY message: the sender's share of the world's contributions (its coverage) and the
    members it counts on."""
    return torch.tensor([weight, *counted_on], dtype=torch.float64).numpy().tobytes()


def read_ready(payload: bytearray) -> tuple[float, set[int]] | None:
    """A READY message's (coverage, members counted on); None if malformed."""
    if len(payload) < 16 or len(payload) % 8:
        return None
    values = torch.frombuffer(payload, dtype=torch.float64)
    return float(values[0]), set(values[1:].long().tolist())
