"""What a Moshpit call reports: its rounds as this peer saw them."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.collectives.base import AllReduceStats


@dataclass(frozen=True)
class RoundStats:
    """One round as this peer saw it. `present`: members whose contribution made it into this
    peer's result in both phases; `coverage`: the fraction of (group member, element) pairs
    that did. `seconds` is the roll call's, then the reduce-scatter's, then the all-gather's
    (the rest): where a slow round lost its time."""

    round_index: int
    axis: int
    group: tuple[int, ...]
    present: tuple[int, ...]
    missing: tuple[int, ...]
    seconds: float
    roll_call_seconds: float
    scatter_seconds: float
    bytes_sent: int
    bytes_received: int
    coverage: float


@dataclass(repr=False)
class MoshpitStats(AllReduceStats):
    """AllReduceStats with the rounds. `coverage` is the fraction of the contributions that the
    same rounds reach with no failures (1.0: the exact mean after d rounds); it is exact when
    peers fail between rounds and estimated when one fails inside a round."""

    rounds: tuple[RoundStats, ...] = ()
