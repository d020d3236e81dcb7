"""A round's vector in parts: one slice per member, each member's payload landing in its slot
block by block as it is read, and this peer's own slice averaged over the contributions that
landed in each block. A call holds its result and a block per connection, not a copy of what
it receives."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from testbed.collectives.estimate import divide_by_chunk
from testbed.collectives.moshpit.protocol import decode_bucket
from testbed.transport.tensors import codec_of
from testbed.transport.wire import FrameHeader

# A payload is read and landed in blocks of this many bytes: all a connection's reader holds
# beyond where the payload belongs.
BLOCK_BYTES = 1 << 16


def member_slices(work: torch.Tensor, members: Sequence[int]) -> dict[int, torch.Tensor]:
    """`work` in one slice per member, in the members' order: views, so what lands in a slice
    lands in `work`."""
    return dict(zip(members, work.tensor_split(len(members)), strict=True))


class Slot:
    """Where one member's slice of a round lands as it is read, block by block: added into this
    peer's own slice (reduce-scatter) or copied over the member's slice of the vector
    (all-gather). `counts` (reduce-scatter) gets one more contribution per block that landed;
    `landed` counts the elements. Only a payload of the round's members (its digest) and of the
    target's size and dtype fits."""

    def __init__(self, target: torch.Tensor, digest: int,
                 counts: torch.Tensor | None = None) -> None:
        self.target, self.digest, self.counts = target, digest, counts
        self.block = BLOCK_BYTES // target.element_size()  # elements per block
        self.landed = 0

    def fits(self, header: FrameHeader) -> bool:
        return (decode_bucket(header.bucket)[2] == self.digest
                and header.codec == codec_of(self.target.dtype)
                and header.length == self.target.numel() * self.target.element_size())

    def land(self, offset: int, piece: memoryview) -> None:
        """A block of the payload, `offset` bytes into it (a multiple of BLOCK_BYTES)."""
        start = offset // self.target.element_size()
        values = torch.frombuffer(piece, dtype=self.target.dtype)
        part = self.target[start:start + values.numel()]
        if self.counts is None:
            part.copy_(values)
        else:
            part.add_(values)
            self.counts[start // self.block] += 1
        self.landed += values.numel()


class Reducer:
    """This peer's own slice of a round and how many contributions each of its blocks holds
    (its own is in every block): the partners' slices are added into it as they land, and
    `average` divides each block by its count (a partner cut off mid-way counts where its
    blocks came)."""

    def __init__(self, own: torch.Tensor) -> None:
        self.own = own
        self.block = BLOCK_BYTES // own.element_size()
        self.counts = torch.ones(max(1, -(-own.numel() // self.block)), dtype=torch.float64)

    def slot(self, digest: int) -> Slot:
        """Where a partner's slice lands: added into this peer's own."""
        return Slot(self.own, digest, self.counts)

    def average(self) -> None:
        if self.own.numel():
            divide_by_chunk(self.own, self.counts, self.block, self.own)
