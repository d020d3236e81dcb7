"""The ring all-reduce over real TCP on loopback: exact, repeatable, clear if a peer is missing."""

from __future__ import annotations

import pytest
import torch

from testbed.collectives.base import Collective
from testbed.collectives.lab import run_concurrently
from testbed.collectives.ring import Ring
from testbed.transport.errors import TransportTimeout
from testbed.transport.tcp import Listener


def ring_of(world: int, timeout: float = 10.0) -> list[Ring]:
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(world)]
    addresses = [listener.address for listener in listeners]
    return run_concurrently(*(
        lambda rank=rank: Ring(rank, world, addresses=addresses, listener=listeners[rank],
                               timeout=timeout)
        for rank in range(world)
    ))


@pytest.mark.parametrize(("world", "numel"), [(2, 100_000), (3, 1_000_003), (4, 3)])
def test_ring_gives_every_worker_the_exact_mean(world, numel):
    rings = ring_of(world)
    try:
        assert all(isinstance(ring, Collective) for ring in rings)
        inputs = [
            torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)
        ]
        originals = [t.clone() for t in inputs]
        results = run_concurrently(*(
            lambda r=r: rings[r].allreduce(inputs[r], step=0) for r in range(world)
        ))
        expected = torch.stack(originals).mean(0)
        for (result, stats), original, given in zip(results, originals, inputs, strict=True):
            torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(given, original), "the input must not be modified"
            assert stats.coverage == 1.0 and stats.collective == "ring"
            # Each worker sends 2(N-1)/N of the tensor, plus frame headers.
            assert stats.bytes_sent >= 2 * (world - 1) * (numel // world) * 4
    finally:
        for ring in rings:
            ring.close()


def test_several_calls_in_one_step_keep_their_order():
    rings = ring_of(3)
    try:
        def worker(rank: int) -> list[torch.Tensor]:
            first, _ = rings[rank].allreduce(torch.full((10,), float(rank)), step=5)
            second, _ = rings[rank].allreduce(torch.full((2, 3), 10.0 * rank), step=5)
            return [first, second]

        for first, second in run_concurrently(*(lambda r=r: worker(r) for r in range(3))):
            assert torch.equal(first, torch.full((10,), 1.0))
            assert torch.equal(second, torch.full((2, 3), 10.0))
    finally:
        for ring in rings:
            ring.close()


def test_a_peer_that_never_starts_is_named_in_the_timeout():
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(3)]
    addresses = [listener.address for listener in listeners]
    try:
        with pytest.raises(TransportTimeout, match=r"rank 1: .* for ranks \[2\]"):
            Ring(1, 3, addresses=addresses, listener=listeners[1], rendezvous_timeout=0.5)
    finally:
        for listener in listeners:
            listener.close()
