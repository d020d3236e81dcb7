"""Moshpit's virtual grid: which peers average together in which round.

Peers sit on a d-dimensional grid (their rank's mixed-radix digits); round r averages within
groups that share every coordinate except axis r mod d. The sides are a factorisation of the
number of peers, so the grid is always full and, with no failures, d rounds of group averages
give exactly the global mean for any number of peers. A prime number of peers gives one group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    """A full grid: `sides[axis]` peers along each axis, `world` = their product."""

    sides: tuple[int, ...]

    @classmethod
    def for_world(cls, world: int, group_size: int = 4) -> Grid:
        """Factor `world` into sides of at most about `group_size` (fewest rounds for that size)."""
        if world < 1:
            raise ValueError(f"world: needs at least one peer, got {world}")
        if group_size < 2:
            raise ValueError(f"group_size: needs at least 2, got {group_size}")
        sides: list[int] = []
        for prime in _prime_factors(world):
            # Put each prime on the smallest side that stays within group_size, else a new axis.
            fitting = [i for i, side in enumerate(sides) if side * prime <= group_size]
            if fitting:
                smallest = min(fitting, key=lambda i: sides[i])
                sides[smallest] *= prime
            else:
                sides.append(prime)
        return cls(tuple(sorted(sides, reverse=True)) or (1,))

    @property
    def world(self) -> int:
        total = 1
        for side in self.sides:
            total *= side
        return total

    @property
    def dims(self) -> int:
        return len(self.sides)

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The rank's position: its mixed-radix digits, least significant axis first."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank: expected 0..{self.world - 1}, got {rank}")
        digits = []
        for side in self.sides:
            rank, digit = divmod(rank, side)
            digits.append(digit)
        return tuple(digits)

    def rank_at(self, coordinates: tuple[int, ...]) -> int:
        rank, scale = 0, 1
        for digit, side in zip(coordinates, self.sides, strict=True):
            rank += digit * scale
            scale *= side
        return rank

    def group(self, rank: int, round_index: int) -> list[int]:
        """The peers `rank` averages with in this round (itself included), in rank order."""
        axis = round_index % self.dims
        coords = list(self.coordinates(rank))
        members = []
        for digit in range(self.sides[axis]):
            coords[axis] = digit
            members.append(self.rank_at(tuple(coords)))
        return members

    def groups(self, round_index: int) -> list[list[int]]:
        """Every group of the round, each once."""
        seen: set[int] = set()
        result = []
        for rank in range(self.world):
            if rank not in seen:
                members = self.group(rank, round_index)
                seen.update(members)
                result.append(members)
        return result


def _prime_factors(number: int) -> list[int]:
    """Prime factors, largest first: large primes claim their own axis before small ones pack."""
    factors, divisor = [], 2
    while divisor * divisor <= number:
        while number % divisor == 0:
            factors.append(divisor)
            number //= divisor
        divisor += 1
    if number > 1:
        factors.append(number)
    return sorted(factors, reverse=True)
