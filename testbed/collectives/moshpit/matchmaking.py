"""Moshpit's group formation: who averages together in a round. The grid (`grid.py`) names the
round's group; its roll call settles which of them take part. Every member sends READY (its
coverage and the members it believes alive) to the others; the round's members are those who
answered and whom every answerer counts on, so all members normally agree on them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from testbed.collectives.moshpit.channel import Channel
from testbed.collectives.moshpit.protocol import Phase, members_digest, read_ready, ready_payload
from testbed.transport.wire import Kind


@dataclass(frozen=True)
class Group:
    """A round's group as this peer formed it: `grid_group`, the round's group on the grid (this
    peer included); `called`, those of it this peer counted on alive (itself not included);
    `members`, the roll call's outcome in rank order (itself included) and their `digest`,
    which every later message of the round carries; `weights`, each answerer's share of the
    world's contributions, as its READY said."""

    grid_group: tuple[int, ...]
    called: tuple[int, ...]
    members: tuple[int, ...]
    digest: int
    weights: Mapping[int, float]


def roll_call(channel: Channel, group: Sequence[int], weight: float, until: float) -> Group:
    """Call the live peers of the grid's `group` and wait until `until` for their READY; this
    peer holds `weight` of the world's contributions. A peer that does not count on this one
    is left out."""
    counted_on = [peer for peer in group if peer == channel.rank or peer in channel.alive]
    called = [peer for peer in counted_on if peer != channel.rank]
    ready = ready_payload(weight, counted_on)
    sends = {peer: channel.send(peer, Kind.CONTROL, Phase.READY, 0, ready) for peer in called}
    views = {channel.rank: (weight, set(counted_on))}
    for peer, message in channel.take(called, Phase.READY, until).items():
        view = read_ready(message.payload)
        if view is not None and channel.rank in view[1]:
            views[peer] = view
    channel.finish(sends, until)
    members = sorted(set(views).intersection(*(view[1] for view in views.values())))
    return Group(grid_group=tuple(group), called=tuple(called), members=tuple(members),
                 digest=members_digest(members),
                 weights={peer: view[0] for peer, view in views.items()})
