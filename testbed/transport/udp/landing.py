"""Where received chunks land: a `Sink` takes a sender's chunks of an opened key as they are
read (`Landing`: into tensors, in place), and `place` scatters chunks kept aside into a tensor.
Chunk i of a tensor holds its elements i * chunk_numel onwards."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from testbed.transport.tensors import bits, codec_of, dtype_of
from testbed.transport.wire import Codec


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


class Sink(Protocol):
    """Where one sender's chunks of an opened key are written as they are read. The endpoint
    hands it only chunks of a `numel`-element tensor of `codec` that are new: the right count,
    each chunk's length right, the first copy of each. With `short_count`, a sender may also
    send only the first `short_count` chunks (each whole): the rest of the layout is optional
    (a broadcast's parity chunks), and once its datagrams say so it is owed no more."""

    codec: Codec
    numel: int
    short_count: int | None

    def land(self, index: np.ndarray, payload: np.ndarray) -> None:
        """Chunks `index` (distinct); row i of `payload` ((k, chunk_numel), the elements as
        same-size integers, a view valid for this call only) holds chunk index[i]; the last
        chunk's row only as far as the tensor goes."""


class Landing:
    """A `Sink` that copies chunks into tensors: chunk i at element i * chunk_numel of the
    concatenation of `parts` (flat, contiguous, one dtype). With two parts (a shard of the
    result and a small side buffer), a message sent from two tensors lands without a joined
    copy on either side. `short_count`: see `Sink`."""

    def __init__(self, parts: Sequence[torch.Tensor], chunk_numel: int,
                 short_count: int | None = None) -> None:
        if len({part.dtype for part in parts}) != 1:
            raise ValueError(f"parts: need one dtype, got {[part.dtype for part in parts]}")
        self.codec = codec_of(parts[0].dtype)
        self.short_count = short_count
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


def expected_chunks(senders: Collection[int], numel: int, chunk_numel: int) -> dict[int, int]:
    """The chunk count of a `numel`-element tensor, per sender: `collect`'s `expected`."""
    return dict.fromkeys(senders, chunk_count(numel, chunk_numel))
