"""Capabilities for a collective no registry entry declares: a user's own gets the conservative
defaults instead of an error naming the registered kinds, so it can be compressed, and every
registered kind still gets its entry's."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from testbed.collectives import registry
from testbed.collectives.base import AllReduceStats, Collective, CollectiveBase
from testbed.collectives.capabilities import UNDECLARED, declared
from testbed.collectives.compression import wrap
from testbed.collectives.lab import run_concurrently

WAIT = 10.0  # seconds a worker waits for the others at the barrier before the test fails


class Board:
    """Where a `ThreadMean`'s workers, threads of one process, leave their inputs."""

    def __init__(self, world: int) -> None:
        self.inputs: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world)


class ThreadMean(CollectiveBase):
    """A user's own collective, registered nowhere: every worker takes the exact mean of what
    all of them left on the board."""

    name = "thread-mean"

    def __init__(self, rank: int, world: int, board: Board) -> None:
        self.rank, self.world, self.board = rank, world, board

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        self.board.inputs[self.rank] = tensor.detach().clone()
        self.board.barrier.wait(WAIT)
        mean = torch.stack(self.board.inputs).mean(0)
        self.board.barrier.wait(WAIT)  # nobody leaves its next input before all have read
        return mean.view_as(tensor), AllReduceStats(self.name, step)

    def close(self) -> None:
        pass


class Plain:
    """A user's own collective that only keeps the contract (no `CollectiveBase`)."""

    name, rank, world = "plain", 0, 1

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        return tensor.clone(), AllReduceStats(self.name, step)

    def close(self) -> None:
        pass


def test_a_users_own_collective_has_the_conservative_defaults():
    assert not any(dataclasses.astuple(UNDECLARED))  # nothing beyond the contract
    assert ThreadMean(0, 1, Board(1)).capabilities == UNDECLARED
    assert isinstance(Plain(), Collective) and declared(Plain.name) == UNDECLARED


@pytest.mark.parametrize("kind", registry.kinds())
def test_every_registered_kind_has_its_entrys_capabilities(kind):
    assert declared(kind) == registry.kind(kind).capabilities


def test_a_users_own_collective_can_be_compressed_and_all_reduces():
    """Rand-K (its coordinates from a shared seed: no exchange needed) over the user's
    collective: EF21M's first call sends every value, so the result is the exact mean; later
    calls send a fraction of them. Int8 needs a reliable exchange, which the defaults do not
    offer: it is refused, naming the collective."""
    world, numel = 3, 1000
    board = Board(world)
    workers = [wrap(ThreadMean(rank, world, board), "randk", density=0.1) for rank in range(world)]
    try:
        assert all(worker.capabilities == UNDECLARED for worker in workers)
        inputs = torch.randn(world, numel, generator=torch.Generator().manual_seed(3))
        for step in range(3):
            results = run_concurrently(*(lambda r=r, s=step: workers[r].allreduce(inputs[r], s)
                                         for r in range(world)))
            if step == 0:
                for result, _ in results:
                    torch.testing.assert_close(result, inputs.mean(0))
            else:
                assert all(stats.extra["compression_ratio"] < 0.5 for _, stats in results)
            assert all(torch.equal(result, results[0][0]) for result, _ in results)
    finally:
        for worker in workers:
            worker.close()
    with pytest.raises(ValueError, match="'thread-mean' has none"):
        wrap(ThreadMean(0, 2, Board(2)), "int8")
