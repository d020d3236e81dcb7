"""The lossy all-reduce's estimator is unbiased under value-independent loss; deadlines adapt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed.collectives.estimate import AdaptiveDeadline, AdaptiveSettle, ChunkAccumulator


def _estimate(grads: torch.Tensor, arrived: torch.Tensor, chunk: int) -> torch.Tensor:
    """What owner 0 computes: its own gradient plus each peer's chunks that arrived."""
    acc = ChunkAccumulator(grads.shape[1], chunk, dtype=grads.dtype)
    acc.add_all(grads[0])
    for peer in range(1, grads.shape[0]):
        for index in torch.nonzero(arrived[peer]).flatten().tolist():
            start, end = acc.bounds(index)
            acc.add_chunk(index, grads[peer, start:end])
    return acc.mean()


def test_mean_of_what_arrived_per_chunk():
    grads = torch.arange(3 * 5, dtype=torch.float64).reshape(3, 5)
    arrived = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    estimate = _estimate(grads, arrived, chunk=2)
    expected = torch.cat([
        grads[:2, 0:2].mean(0),  # chunk 0: owner and peer 1
        grads[:1, 2:4].mean(0),  # chunk 1: only the owner
        grads[:, 4:5].mean(0),   # chunk 2: everyone
    ])
    torch.testing.assert_close(estimate, expected)


@pytest.mark.parametrize("loss", [0.1, 0.3, 0.5])
def test_unbiased_under_value_independent_loss(loss):
    """Peers' gradients are noisy draws around a true gradient; over many trials with random
    loss, the estimate's mean matches the true gradient within its standard error (z < 4)."""
    generator = torch.Generator().manual_seed(1234)
    world, numel, chunk, trials = 8, 64, 8, 4000
    true = torch.randn(numel, dtype=torch.float64, generator=generator)
    estimates = torch.empty(trials, numel, dtype=torch.float64)
    for trial in range(trials):
        grads = true + torch.randn(world, numel, dtype=torch.float64, generator=generator)
        arrived = torch.rand(world, numel // chunk, generator=generator) >= loss
        estimates[trial] = _estimate(grads, arrived, chunk)
    standard_error = estimates.std(0) / trials**0.5
    z = (estimates.mean(0) - true) / standard_error
    assert z.abs().max() < 4.0, f"largest z-score {z.abs().max():.2f}"
    # Loss costs variance, not bias: fewer contributions, larger spread than with none lost.
    assert estimates.var(0).mean() > 1.0 / world


def test_chunks_added_at_once_add_like_one_by_one():
    """As a batch comes off the wire: rows of chunk_numel values, in any order, the last
    chunk's row longer than the shard's tail (its extra values are not the shard's)."""
    grads = torch.arange(2 * 7, dtype=torch.float64).reshape(2, 7)
    arrived = torch.tensor([[True, True, True, True], [True, False, False, True]])
    by_chunk = _estimate(grads, arrived, chunk=2)
    acc = ChunkAccumulator(7, 2, dtype=grads.dtype)
    acc.add_all(grads[0])
    rows = torch.cat([grads[1], torch.tensor([99.0], dtype=grads.dtype)]).view(4, 2).numpy()
    index = np.array([3, 0])
    acc.add_chunks(index, rows[index])
    torch.testing.assert_close(acc.mean(), by_chunk)
    expected = torch.tensor([2.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(acc.coverage(), expected)
    out = torch.empty(7, dtype=grads.dtype)
    assert acc.mean(out=out) is out
    torch.testing.assert_close(out, by_chunk)
    acc.mean(out=acc.total)  # in place
    torch.testing.assert_close(acc.total, by_chunk)


def test_weights_count_micro_batches():
    acc = ChunkAccumulator(4, 4)
    acc.add_all(torch.full((4,), 1.0), weight=3)  # three micro-batches computed
    acc.add_chunk(0, torch.full((4,), 5.0), weight=1)  # one computed before the cut-off
    torch.testing.assert_close(acc.mean(), torch.full((4,), 2.0))


def test_wrong_chunk_size_is_refused():
    acc = ChunkAccumulator(10, 4)
    with pytest.raises(ValueError, match="chunk 2: expected 2 values"):
        acc.add_chunk(2, torch.zeros(4))


def test_deadline_follows_arrivals_and_grows_after_late_chunks():
    deadline = AdaptiveDeadline(floor=0.001, initial=1.0, ceiling=10.0, margin=1.5, trust=8)
    assert deadline.seconds == 1.0
    for _ in range(7):  # too few calls to go below the initial deadline
        deadline.observe(0.02)
    assert deadline.seconds == 1.0
    for _ in range(13):
        deadline.observe(0.02)
    assert deadline.seconds == pytest.approx(0.03)
    before = deadline.seconds
    for _ in range(20):  # chunks keep arriving after the deadline: it was too short
        deadline.observe(deadline.seconds, late_chunks=3)
    assert deadline.seconds > 10 * before
    assert deadline.seconds <= 10.0


def test_the_settle_falls_while_nothing_comes_late_and_doubles_when_something_does():
    settle = AdaptiveSettle(floor=0.001, ceiling=0.01, shrink=0.8)
    assert settle.seconds == 0.01  # it starts where it is safe
    for _ in range(11):
        settle.observe(0)
    assert settle.seconds == pytest.approx(0.001)  # 0.01 * 0.8**11 < 0.001: the floor
    settle.observe(3)
    assert settle.seconds == pytest.approx(0.002)
    for _ in range(5):
        settle.observe(1)
    assert settle.seconds == 0.01
