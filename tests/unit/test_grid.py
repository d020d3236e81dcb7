"""Moshpit's grid: groups partition the peers, and d rounds of group means give the exact mean."""

from __future__ import annotations

import pytest
import torch

from testbed.collectives.grid import Grid

WORLDS = [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 18, 31, 32, 64]


@pytest.mark.parametrize("world", WORLDS)
def test_groups_partition_the_peers_every_round(world):
    grid = Grid.for_world(world)
    assert grid.world == world
    for round_index in range(grid.dims):
        members = sorted(rank for group in grid.groups(round_index) for rank in group)
        assert members == list(range(world))
        for group in grid.groups(round_index):
            for rank in group:
                assert grid.group(rank, round_index) == group


def _group_means(grid: Grid, values: torch.Tensor, rounds: int, alive=None) -> torch.Tensor:
    values = values.clone()
    for round_index in range(rounds):
        for group in grid.groups(round_index):
            present = [r for r in group if alive is None or alive[round_index, r]]
            if present:
                values[present] = values[present].mean(0)
    return values


@pytest.mark.parametrize("world", WORLDS)
def test_exact_global_average_after_d_rounds(world):
    grid = Grid.for_world(world)
    values = torch.randn(world, 7, dtype=torch.float64)
    averaged = _group_means(grid, values, grid.dims)
    torch.testing.assert_close(averaged, values.mean(0).expand_as(values))


def test_converges_with_a_fifth_of_peers_failing_every_round():
    grid = Grid.for_world(16)
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(16, 5, dtype=torch.float64, generator=generator)
    rounds = 12
    alive = torch.rand(rounds, 16, generator=generator) >= 0.2
    averaged = _group_means(grid, values, rounds, alive)
    assert averaged.std(0).max() < 0.05 * values.std(0).min()
    # Failures perturb the mean only a little: the absent keep their own values.
    torch.testing.assert_close(averaged.mean(0), values.mean(0), atol=0.3, rtol=0)


def test_group_size_controls_sides():
    assert Grid.for_world(16, group_size=2).sides == (2, 2, 2, 2)
    assert Grid.for_world(16, group_size=16).sides == (16,)
    with pytest.raises(ValueError, match="world"):
        Grid.for_world(0)
    with pytest.raises(ValueError, match="rank"):
        Grid.for_world(4).coordinates(4)
