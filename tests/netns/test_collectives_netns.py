"""Collectives across a lab of namespaces whose links lose packets (the host kernel's fallback
shaping, on the switch ports towards the receivers): the ring stays exact over TCP and the loss
shows up in the kernel's retransmits; the lossy all-reduce loses chunks, estimates the mean
from those that came, and keeps every copy of the parameters a recent value of its owner's."""

from __future__ import annotations

import pytest
import torch

from netem import LinkProfile
from testbed.collectives.lab import lossy_workers, rings, run_concurrently, shape_every_link
from testbed.collectives.lossy import Lossy, LossyStats

pytestmark = pytest.mark.netns

WORLD = 4
LOSS = 0.10


def lossy_lab(make_lab, world: int, **options) -> list[Lossy]:
    """`world` lossy workers, one per namespace, every link into every host losing LOSS."""
    lab = make_lab(world)
    shape_every_link(lab, LinkProfile.parse(loss=f"{LOSS:.0%}"), backend="fallback")
    return lossy_workers(lab, deadline_initial=0.5, **options)


def test_ring_is_exact_across_lossy_links_and_counts_retransmits(make_lab):
    lab = make_lab(WORLD)
    # every link into every host loses 5%
    shape_every_link(lab, LinkProfile.parse(loss="5%"), backend="fallback")
    workers = rings(lab, timeout=30)
    try:
        inputs = [torch.randn(1_000_000, generator=torch.Generator().manual_seed(r))
                  for r in range(WORLD)]
        expected = torch.stack(inputs).mean(0)
        for step in range(2):
            results = run_concurrently(*(
                lambda r=r, s=step: workers[r].allreduce(inputs[r], s) for r in range(WORLD)
            ))
            for result, _ in results:
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
        retransmits = sum(stats.extra["tcp_retransmits"] for _, stats in results)
        assert retransmits > 0, "5% loss on every link, yet TCP retransmitted nothing"
    finally:
        for worker in workers:
            worker.close()


def test_lossy_all_reduce_estimates_the_mean_from_the_chunks_that_came(make_lab):
    world, numel = 3, 300_000
    group = lossy_lab(make_lab, world)
    try:
        mean = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        inputs = [mean + 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(r))
                  for r in range(1, world + 1)]
        expected = torch.stack(inputs).mean(0)
        everything: list[LossyStats] = []
        for step in range(10):  # past the 8 calls a deadline is learned from
            results = run_concurrently(*(
                lambda r=r, s=step: group[r].allreduce(inputs[r], s) for r in range(world)
            ))
            for rank, (result, stats) in enumerate(results):
                # Averaging what came must beat a worker's own input alone by far.
                error = (result - expected).norm() / expected.norm()
                alone = (inputs[rank] - expected).norm() / expected.norm()
                assert error < 0.8 * alone, f"step {step}: relative error {error:.3f}"
                everything.append(stats)
        # Per owner: its own and 90% of two peers' chunks (0.93); less what a deadline cuts off
        # (those come late, and the deadline grows).
        shard = sum(s.extra["shard_coverage"] for s in everything) / len(everything)
        assert 0.88 < shard < 0.96, shard
        # Then 90% of the broadcasts come; elsewhere the own value stands (1 of 3).
        coverage = sum(s.coverage for s in everything) / len(everything)
        assert 0.8 < coverage < 0.93, coverage
        assert all(s.extra["datagrams_lost"] > 0 for s in everything[-world:]), \
            "sequence numbers must show the datagrams the links dropped"
        assert all(s.extra["deadline_seconds"] < 0.5 for s in everything[-world:]), \
            "the deadline should have been learned from the first 8 steps"
    finally:
        for collective in group:
            collective.close()


def test_sharded_sgd_under_loss_converges_and_copies_stay_recent_owner_values(make_lab):
    """Each worker pulls towards its own target; the owners' parameters converge to the mean
    target (up to the noise of averaging over the chunks that came), and every element of every
    copy is a value its owner held since the last resync (stale where broadcasts were lost,
    never anything else)."""
    world, numel, steps, resync_every = 3, 200_000, 8, 4
    group = lossy_lab(make_lab, world, resync_every=resync_every)
    try:
        common = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        targets = [common + 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(r))
                   for r in range(1, world + 1)]
        goal = torch.stack(targets).mean(0)
        copies = [torch.zeros(numel)] * world
        shards = [slice(int(part[0]), int(part[-1]) + 1)
                  for part in torch.tensor_split(torch.arange(numel), world)]

        def update(start: int, parameters: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
            return parameters - 0.5 * gradient

        history = [torch.zeros(numel)]  # the owners' parameters after each step
        received = []
        for step in range(steps):
            results = run_concurrently(*(
                lambda r=r, s=step, p=copies[r]: group[r].step(p, p - targets[r], s, update)
                for r in range(world)
            ))
            copies = [parameters for parameters, _ in results]
            owners = torch.cat([copies[owner][shard] for owner, shard in enumerate(shards)])
            history.append(owners)
            recent = torch.stack(history[step + 1 - (step + 1) % resync_every:])
            for rank, (parameters, stats) in enumerate(results):
                assert stats.extra["resync"] == float((step + 1) % resync_every == 0)
                assert torch.isclose(parameters, recent).any(0).all(), \
                    f"step {step}: rank {rank} holds values its owners never had lately"
                if stats.extra["resync"]:
                    assert torch.equal(parameters, owners)
                else:
                    received.append(stats.extra["broadcast_received"])
        # 90% come; a step whose deadline is still being learned may cut off some more
        assert 0.8 < sum(received) / len(received) < 0.95, received
        start, end = goal.norm(), (history[-1] - goal).norm()
        assert end < 0.1 * start, f"distance to the mean target: {start:.1f} -> {end:.1f}"
    finally:
        for collective in group:
            collective.close()
