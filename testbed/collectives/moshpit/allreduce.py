"""The all-reduce within one Moshpit group, once its members are known: the vector is split
into one slice per member; in the reduce-scatter each member sends slice i to member i and
averages its own slice over the contributions that came in time, in the all-gather each member
sends its averaged slice to the others. What comes lands where it belongs as it is read."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from testbed.collectives.moshpit.channel import Channel
from testbed.collectives.moshpit.matchmaking import Group
from testbed.collectives.moshpit.partition import Reducer, Slot, member_slices
from testbed.collectives.moshpit.protocol import Phase
from testbed.collectives.moshpit.schedule import Schedule
from testbed.transport.wire import Kind


@dataclass(frozen=True)
class GroupAverage:
    """What a group's all-reduce left in this peer's vector. `present`: the members whose
    contribution made it in both phases (this peer included); `coverage`: the fraction of
    (grid group member, element) pairs that did; `weight`: the vector's new share of the
    world's contributions."""

    present: tuple[int, ...]
    coverage: float
    weight: float
    scatter_seconds: float  # the reduce-scatter's, its sends finished; the rest is the gather's


def average_in_group(channel: Channel, group: Group, work: torch.Tensor, weight: float,
                     schedule: Schedule, position: int) -> GroupAverage:
    """Average `work` in place with `group`'s members, each phase within its share of the call
    (`schedule`; this is the call's `position`-th round); `work` holds `weight` of the world's
    contributions."""
    slices = member_slices(work, group.members)
    partners = [peer for peer in group.members if peer != channel.rank]
    own = slices[channel.rank]

    # Reduce-scatter: the partners' slices are added into our own as they are read, with
    # the contributions counted per block (a partner cut off mid-way counts where its
    # blocks came). Peers left out hear it at once from the digest of an empty message
    # (not waited for: it carries none of `work`, and its peer may well be dead).
    until, started = schedule.scatter(position), time.monotonic()
    reducer = Reducer(own)  # our own contribution is in every block
    scatter = {peer: reducer.slot(group.digest) for peer in partners}
    channel.open(Phase.SCATTER, scatter)
    for peer in group.called:
        if peer not in slices:
            channel.send(peer, Kind.GRADIENT, Phase.SCATTER, group.digest, b"")
    sends = {peer: channel.send(peer, Kind.GRADIENT, Phase.SCATTER, group.digest, slices[peer])
             for peer in partners}
    channel.wait(partners, Phase.SCATTER, until)
    answered = sorted(channel.end(Phase.SCATTER, partners))
    channel.finish(sends, until)  # they read slices that the all-gather overwrites
    reducer.average()
    shares = {peer: scatter[peer].landed / max(1, own.numel()) for peer in partners}

    # All-gather, from those who answered (the others are presumed gone): each member's
    # averaged slice is copied over its slice of `work` as it is read.
    until, scattered = schedule.gather(position), time.monotonic()
    gather = {peer: Slot(slices[peer], group.digest) for peer in answered}
    channel.open(Phase.GATHER, gather)
    sends = {peer: channel.send(peer, Kind.PARAMETER, Phase.GATHER, group.digest, own)
             for peer in partners}
    channel.wait(answered, Phase.GATHER, until)
    gathered = channel.end(Phase.GATHER, answered)
    channel.finish(sends, until)  # `work` is the caller's next

    # Slices averaged by a member hold what our own slice holds; the others only ours.
    pooled_numel = own.numel() + sum(slot.landed for slot in gather.values())
    averaged = pooled_numel / work.numel() if work.numel() else 1.0
    pooled = weight + sum(group.weights[peer] * share for peer, share in shares.items())
    return GroupAverage(
        present=tuple(sorted({channel.rank, *gathered})),
        coverage=((averaged * (1 + sum(shares.values())) + 1 - averaged)
                  / len(group.grid_group)),
        weight=averaged * pooled + (1 - averaged) * weight,
        scatter_seconds=scattered - started)
