"""A run's secret: a keyed MAC on every datagram and a proof of the key in every TCP hello.

Where the network is shared (a Compose network, a Swarm overlay), anyone on it can reach a
worker's ports, write any header and forge the source address of a peer. With a key of the run
(KEY_BYTES random bytes that the placement hands each worker in a file only its owner can
read, `write_key`/`read_key`), every datagram ends in a MAC_SIZE-byte keyed BLAKE2b of its
receiver's rank, its header and its payload (`DatagramMac`): without the key, nothing a stranger
makes is taken; the receiver's rank keeps a genuine datagram from being replayed to another
worker, and the sequence number and incarnation it covers let the replay window refuse one
replayed to the same worker. A TCP caller proves the key by a MAC of a nonce the listener chose
for that connection (`hello_proof`), which a passive observer cannot replay.

hashlib's BLAKE2b is one Python call per datagram: benchmarks/results/datagram-cost.md has
what it costs. No torch here.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KEY_BYTES = 32  # what `write_key` makes
MIN_KEY_BYTES = 16  # what `read_key` takes
MAC_SIZE = 16  # bytes of MAC after each datagram's payload
NONCE_SIZE = 16  # the listener's challenge to a TCP caller
_DATAGRAM = b"testbed-datagram"  # BLAKE2b personalisation: a datagram MAC is no hello proof
_HELLO = b"testbed-hello"
_RANK = struct.Struct("!H")
_GREETING = struct.Struct("!IHH")  # run id, caller, target


class DatagramMac:
    """The MACs of one key: `sign` for a tensor's datagrams to one receiver, `verify` for a
    batch this endpoint received."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"key: expected at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self._states: dict[int, hashlib._Hash] = {}

    def _state(self, receiver: int) -> hashlib._Hash:
        """The keyed state with the receiver's rank taken in, copied for each datagram."""
        state = self._states.get(receiver)
        if state is None:
            state = hashlib.blake2b(_RANK.pack(receiver), key=self._key, digest_size=MAC_SIZE,
                                    person=_DATAGRAM)
            self._states[receiver] = state
        return state

    def sign(self, receiver: int, headers: np.ndarray, parts: Sequence[np.ndarray],
             starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The MACs ((n, MAC_SIZE) uint8) of n datagrams to `receiver`: datagram i is
        `headers[i]` followed by bytes starts[i]:ends[i] of the concatenation of `parts`
        (uint8 arrays), read where they are."""
        state = self._state(receiver)
        width = headers.shape[1]
        head = memoryview(np.ascontiguousarray(headers).reshape(-1))
        views = [memoryview(part) for part in parts]
        offsets = np.cumsum([0, *(len(view) for view in views)]).tolist()
        out = bytearray(MAC_SIZE * len(starts))
        for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            mac = state.copy()
            mac.update(head[i * width:(i + 1) * width])
            for view, offset in zip(views, offsets, strict=False):
                lo, hi = max(start - offset, 0), min(end - offset, len(view))
                if lo < hi:
                    mac.update(view[lo:hi])
            out[i * MAC_SIZE:(i + 1) * MAC_SIZE] = mac.digest()
        return np.frombuffer(out, dtype=np.uint8).reshape(-1, MAC_SIZE)

    def verify(self, receiver: int, rows: np.ndarray, which: np.ndarray,
               ends: np.ndarray) -> np.ndarray:
        """Whether each datagram `which[j]` of `rows` (a C-contiguous (k, stride) uint8 array,
        one datagram per row) carries the MAC of its first `ends[j]` bytes right after them,
        a bool each. Every MAC is computed before any is compared, and all of its bytes are
        compared: how long a check takes says nothing about how close a forgery came."""
        state = self._state(receiver)
        stride = rows.shape[1]
        flat = memoryview(rows.reshape(-1))
        digests = bytearray(MAC_SIZE * len(which))
        for j, (i, end) in enumerate(zip(which.tolist(), ends.tolist(), strict=True)):
            mac = state.copy()
            mac.update(flat[i * stride:i * stride + end])
            digests[j * MAC_SIZE:(j + 1) * MAC_SIZE] = mac.digest()
        expected = np.frombuffer(digests, dtype=np.uint8).reshape(-1, MAC_SIZE)
        carried = rows[which[:, None], ends[:, None] + np.arange(MAC_SIZE)]
        return (expected == carried).all(axis=1)


def hello_proof(key: bytes, nonce: bytes, run_id: int, caller: int, target: int) -> bytes:
    """What a TCP caller sends to prove the run's key: a MAC of the listener's `nonce`, the run
    and both ranks."""
    greeting = _GREETING.pack(run_id, caller, target) + nonce
    return hashlib.blake2b(greeting, key=key, digest_size=MAC_SIZE, person=_HELLO).digest()


def write_key(path: Path) -> None:
    """A new key of KEY_BYTES random bytes in `path`, readable by its owner only (mode 0600
    from its creation, never wider); a file there before is replaced."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(os.urandom(KEY_BYTES))


def read_key(path: Path) -> bytes:
    """The key in `path`; ValueError if others may read the file or it is too short to be
    one (the message names the path, never the key)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(f"{path}: a run's key must be readable by its owner only (mode 600), "
                         f"this file has mode {mode:o}")
    key = path.read_bytes()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path}: a run's key has at least {MIN_KEY_BYTES} bytes, this file "
                         f"{len(key)}")
    return key
