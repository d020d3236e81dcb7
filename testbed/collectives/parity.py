"""XOR parity over a broadcast's chunks, so a receiver rebuilds a lost chunk exactly.

The chunks of a message (chunk i: elements i * n onwards, as the transport cuts it) are taken
in groups of `group`; each group's parity chunk is the bitwise XOR of its chunks (a short last
group counts as padded with zero chunks). A receiver that lost exactly one chunk of a group and
got its parity chunk rebuilds the lost one bit for bit: the XOR of the parity with the chunks
that came. A group that lost two or more stays as lost. With loss p on every datagram, a chunk
stays lost with probability p (1 - (1 - p)^group), for 1/group more bytes: group 1 sends every
chunk twice (p^2), group 4 at 10% loss leaves 3.4% of the chunks lost instead of 10%.

Everything is numpy on whole groups at once: the elements travel as same-size integers
(`testbed.transport.tensors.bits`), so any dtype XORs alike.
"""

from __future__ import annotations

import numpy as np

from testbed.transport.udp import Landing


def parity_chunks(chunks: int, group: int) -> int:
    """Parity chunks a message of `chunks` data chunks carries."""
    return -(-chunks // group)


def xor_parity(parts: list[np.ndarray], n: int, group: int) -> np.ndarray:
    """The parity chunks ((P, n)) of the message that is the concatenation of `parts` (flat,
    one integer dtype, a whole number of n-element chunks together), in groups of `group`
    chunks. The whole groups of the first part (the bulk: a shard) are reduced as a view; only
    the rest is joined (under a group and the small parts after it)."""
    first = parts[0]
    whole = first.size // (group * n)
    head = np.bitwise_xor.reduce(first[:whole * group * n].reshape(whole, group, n), axis=1)
    rest = np.concatenate([first[whole * group * n:], *parts[1:]])
    if not rest.size:
        return head
    tail = np.zeros(parity_chunks(rest.size // n, group) * group * n, dtype=rest.dtype)
    tail[:rest.size] = rest
    return np.concatenate([head, np.bitwise_xor.reduce(tail.reshape(-1, group, n), axis=1)])


def repair(landing: Landing, arrived: np.ndarray, parity: np.ndarray, chunks: int,
           group: int) -> np.ndarray:
    """Rebuild in `landing` every data chunk that is the only one of its group missing where
    the group's parity chunk came. `arrived`: a bool per chunk of the message (`chunks` data
    chunks, then the parity chunks), updated in place; `parity`: the parity chunks' rows as
    landed. Returns the indexes of the chunks rebuilt."""
    groups = parity_chunks(chunks, group)
    index = np.arange(groups * group).reshape(groups, group)  # data chunks by group
    real = index < chunks
    came = np.where(real, arrived[np.minimum(index, chunks - 1)], True)
    fixable = ((~came).sum(axis=1) == 1) & arrived[chunks:chunks + groups]
    if not fixable.any():
        return np.zeros(0, dtype=np.int64)
    members, present = index[fixable], came[fixable] & real[fixable]
    rows = landing.read(np.where(present, members, 0).reshape(-1)).reshape(
        members.shape[0], group, -1)
    rows[~present] = 0  # the lost chunk and the padding do not count
    lost = members[~came[fixable]]
    landing.land(lost, parity[fixable] ^ np.bitwise_xor.reduce(rows, axis=1))
    arrived[lost] = True
    return lost
