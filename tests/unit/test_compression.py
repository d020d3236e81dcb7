"""Compressed collectives in one process: quantization within its bound per group, INT4
packing, EF21M's bounded error, and, over real rings and lossy groups on loopback, ARC-Top-K's
pattern the same on every worker, every compressor close to the true mean, Top-K's all-gather
exact, and the stats' figures."""

from __future__ import annotations

import math

import pytest
import torch

from testbed.collectives.compression import quantize as q
from testbed.collectives.compression import wrap
from testbed.collectives.compression.feedback import EF14, EF21M
from testbed.collectives.compression.sparsify import (
    count_of,
    layout,
    marginal_scores,
    marginal_sketch,
    projection_layout,
    projection_pattern,
    projection_sketch,
    projections,
    random_coordinates,
    top_coordinates,
)
from testbed.collectives.lab import run_concurrently
from testbed.collectives.lossy import Lossy
from testbed.collectives.ring import Ring
from testbed.transport.tcp import Listener
from testbed.transport.udp import DatagramEndpoint

# --- quantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("group", [32, 128, 256])
def test_quantization_error_is_within_the_bound_of_every_group(bits, symmetric, stochastic,
                                                               group):
    fmt = q.Format(bits, group, symmetric, stochastic)
    generator = torch.Generator().manual_seed(1)
    # Groups of very different scales, an all-zero group, a constant group, a ragged end.
    x = torch.randn(10 * group + group // 2 + 1, generator=generator)
    x[:group] *= 1000
    x[group: 2 * group] = 0
    x[2 * group: 3 * group] = 3.5
    x[3 * group: 4 * group] = torch.rand(group, generator=generator) + 7  # all positive
    quantized = q.quantize(x, fmt, generator)
    back = q.dequantize(quantized)
    assert back.shape == x.shape
    error = torch.zeros(quantized.scale.numel() * group)
    error[: x.numel()] = (back - x).abs()
    bound = q.error_bound(quantized)
    per_group = error.view(-1, group).amax(dim=1)
    slack = 1e-6 * (1 + x.abs().max())  # float rounding of the scale arithmetic
    assert torch.all(per_group <= bound + slack), (per_group - bound).max()
    # The bound is not vacuous: scale is what the group's range over the levels says.
    groups = torch.zeros(quantized.scale.numel() * group)
    groups[: x.numel()] = x
    g = groups.view(-1, group)
    expected = (g.abs().amax(1) / fmt.levels if symmetric
                else (g.amax(1) - g.amin(1)) / fmt.levels)
    torch.testing.assert_close(quantized.scale, expected)
    assert per_group[1] == 0, "an all-zero group comes back exact"
    if not symmetric:
        assert per_group[2] == 0, "a constant group comes back exact (asymmetric)"
    # The wire bytes say the same.
    data = q.to_bytes(quantized)
    assert data.numel() == fmt.wire_size(x.numel())
    torch.testing.assert_close(q.dequantize(q.from_bytes(data, x.numel(), fmt)), back)


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    fmt = q.Format(4, 32, True, True)
    x = torch.full((32,), 0.3)
    x[0] = 7.0  # scale 1: 0.3 is 0.3 of the way between levels 0 and 1
    generator = torch.Generator().manual_seed(0)
    mean = torch.stack([q.dequantize(q.quantize(x, fmt, generator)) for _ in range(2000)]).mean(0)
    assert abs(mean[1:].mean().item() - 0.3) < 0.01
    nearest = q.dequantize(q.quantize(x, q.Format(4, 32, True, False)))
    assert nearest[1:].eq(0).all()


def test_int4_packing_round_trips_and_halves_the_bytes():
    codes = torch.randint(0, 16, (4096,), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    packed = q.pack4(codes)
    assert packed.numel() == 2048 and packed.dtype == torch.uint8
    assert torch.equal(q.unpack4(packed), codes)
    assert packed[0] == (codes[0] | (codes[1] << 4))  # first of a pair in the low nibble
    assert q.Format(4, 128).wire_size(1024) == 8 * 4 + 512
    assert q.Format(8, 128, symmetric=False).wire_size(1024) == 8 * 8 + 1024


def test_a_bad_format_names_the_parameter():
    with pytest.raises(ValueError, match="bits: expected one of 8, 4"):
        q.Format(bits=2)
    with pytest.raises(ValueError, match="group_size"):
        q.Format(group=33)


# --- EF21M --------------------------------------------------------------------------------------


def topk_compressor(density: float):
    def compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.topk(x.abs(), count_of(density, x.numel())).indices
        return index, x[index]
    return compress


@pytest.mark.parametrize("momentum", [1.0, 0.2])
def test_ef21m_keeps_the_accumulated_error_bounded(momentum):
    """Over many steps of slowly changing gradients and a fixed 1% Top-K, what EF21M holds back
    (||v - g||) stays bounded, and the shared estimate tracks the momentum; without error
    feedback the same compressor loses 99% of the coordinates every step for good."""
    n, steps, workers = 2000, 600, 3
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(workers, n, generator=generator)
    states = [EF21M(momentum) for _ in range(workers)]
    compress = topk_compressor(0.01)
    residuals, gaps = [], []
    for state, grad in zip(states, base, strict=True):  # the first step: sent whole
        state.start(grad, base.mean(0))
    for step in range(1, steps):
        drift = 1 + 0.5 * math.sin(step / 50)
        grads = base * drift + 0.1 * torch.randn(workers, n, generator=generator)
        sent = []
        for state, grad in zip(states, grads, strict=True):
            index, values = compress(state.target(grad))
            sent.append((index, values))
        mean = torch.zeros(n)
        for index, values in sent:
            mean.index_add_(0, index, values / workers)
        shared = [state.commit(index, values, None, mean)
                  for state, (index, values) in zip(states, sent, strict=True)]
        residuals.append(max(state.residual for state in states))
        v_mean = torch.stack([state.v for state in states]).mean(0)
        gaps.append(float(torch.linalg.vector_norm(shared[0] - v_mean)
                          / torch.linalg.vector_norm(v_mean)))
    norm = float(torch.linalg.vector_norm(base, dim=1).max()) * 1.5
    late, early = max(residuals[steps // 2:]), max(residuals[: steps // 2])
    assert early > 0, "the drift leaves something to hold back"
    assert late < 1.5 * early + 1e-6, "the held-back error keeps growing"
    assert late < 5 * norm, (late, norm)
    assert all(torch.equal(state.shared, states[0].shared) for state in states)
    # The shared estimate g is within a modest fraction of the mean momentum.
    assert max(gaps[steps // 2:]) < 0.7, max(gaps[steps // 2:])


def test_ef21m_state_follows_its_recurrence():
    """EF21M's state, step by step against the recurrence written out: the first step starts
    v_i = g_i = d_i and g = the mean (sent whole); then v_i <- (1 - eta) v_i + eta d_i, the
    compressor sees v_i - g_i, g_i <- g_i + c_i, g <- g + mean c (exact arithmetic on small
    integers and halves: every value is exact in fp32)."""
    eta = 0.5
    state = EF21M(eta)
    assert not state.started
    with pytest.raises(RuntimeError, match="start"):
        state.target(torch.zeros(4))
    d0 = torch.tensor([4.0, -2.0, 0.0, 8.0])
    shared = state.start(d0, torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert state.started and shared.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert state.v.tolist() == state.own.tolist() == d0.tolist() and state.residual == 0.0
    d1 = torch.tensor([0.0, 2.0, 4.0, 8.0])
    v1 = (1 - eta) * d0 + eta * d1  # [2, 0, 2, 8]
    x = state.target(d1)
    assert torch.equal(state.v, v1) and torch.equal(x, v1 - d0)  # [-2, 2, 2, 0]
    # A compressor that keeps coordinates 0 and 2; the mean of the workers' c is given.
    index, values = torch.tensor([0, 2]), x[torch.tensor([0, 2])]
    result = state.commit(index, values, torch.tensor([0, 2]), torch.tensor([0.5, -1.0]))
    assert state.own.tolist() == [2.0, -2.0, 2.0, 8.0]  # g_i + c_i
    assert result.tolist() == [1.5, 1.0, 0.0, 1.0]  # g + mean c at the shared pattern
    assert state.residual == pytest.approx(2.0)  # ||v_i - g_i||: coordinate 1 held back
    # A dense mean (Top-K's all-gathered sum) adds everywhere.
    assert state.commit(index, values, None, torch.ones(4)).tolist() == [2.5, 2.0, 1.0, 2.0]


def test_ef14_state_follows_its_recurrence():
    """EF14: the compressor sees d_i + e_i, the error keeps what was not sent, the result is
    the mean of what was (dense), and nothing starts whole."""
    state = EF14()
    x = state.target(torch.tensor([4.0, -2.0, 1.0]))
    assert x.tolist() == [4.0, -2.0, 1.0] and state.started
    result = state.commit(torch.tensor([0]), x[:1], torch.tensor([0, 2]),
                          torch.tensor([1.5, 0.5]))
    assert result.tolist() == [1.5, 0.0, 0.5]
    assert state.error.tolist() == [0.0, -2.0, 1.0] and state.residual == pytest.approx(5 ** 0.5)
    x = state.target(torch.tensor([1.0, 1.0, 1.0]))
    assert x.tolist() == [1.0, -1.0, 2.0]
    state.commit(torch.tensor([2]), x[2:], None, torch.zeros(3))
    assert state.error.tolist() == [1.0, -1.0, 0.0]


def test_ef21m_rejects_a_momentum_out_of_range():
    with pytest.raises(ValueError, match="momentum"):
        EF21M(0.0)


# --- patterns -----------------------------------------------------------------------------------


def test_ties_go_to_the_lower_coordinates_and_seeds_agree():
    scores = torch.tensor([1.0, 5.0, 5.0, 0.0, 5.0, 9.0])
    assert top_coordinates(scores, 3).tolist() == [1, 2, 5], "ties go to the lower coordinate"
    assert top_coordinates(scores, 6).tolist() == list(range(6))
    a, b = random_coordinates(1000, 10, 3, 7, 1), random_coordinates(1000, 10, 3, 7, 1)
    assert torch.equal(a, b) and a.unique().numel() == 10
    assert not torch.equal(a, random_coordinates(1000, 10, 3, 8, 1))


def test_the_layout_follows_the_shapes_or_falls_back_to_blocks():
    shapes = [(40, 3, 3), (40,), (10, 360), (2, 2)]
    numel = 40 * 9 + 40 + 3600 + 4
    # A 2 x 2 weight is cheaper sketched per coordinate (4 values) than as a matrix (5).
    assert layout(shapes, numel, 64) == [(0, 40, 9), (360, 40, 1), (400, 10, 360),
                                         (4000, 4, 1)]
    assert layout(shapes, numel + 1, 64) == [(0, 62, 64), (3968, 37, 1)], "shapes that do " \
        "not add up (a DDP bucket): rows of `block` values and the ragged end"
    assert layout(None, 128, 64) == [(0, 2, 64)]


def test_the_projection_layout_views_weights_as_the_paper_does():
    """Projection: a 2-D weight as it is, a 3x3 convolution as rows of 2 * 3^2 = 18 values
    (two kernels a row) where 18 divides it, else shape[0] x the rest, a vector whole (cols
    0); without shapes, rows of `block` values and the ragged end whole."""
    shapes = [(40, 30), (40,), (32, 16, 3, 3), (5, 1, 3, 3), (1, 7), (7, 1)]
    numel = 1200 + 40 + 4608 + 45 + 7 + 7
    assert projection_layout(shapes, numel, 64) == [
        (0, 40, 30), (1200, 40, 0), (1240, 256, 18), (5848, 5, 9), (5893, 1, 7),
        (5900, 7, 0)]
    assert projection_layout(None, 130, 64) == [(0, 2, 64), (128, 2, 0)]
    assert projection_layout(shapes, numel + 1, 16)[-1] == (5904, 4, 0)  # 369 rows of 16


def aggregate_rows(x: torch.Tensor, rows: int, cols: int, world: int) -> torch.Tensor:
    """The published selection written out on the aggregate: the rows' ||mean_i(Y_i) V||^2
    with the V every worker draws."""
    return x.view(world, rows, cols).mean(0)


def test_the_projection_sketch_keeps_the_aggregates_strongest_rows():
    """Four workers' 60 x 50 weight gradients whose mean has 6 rows of energy about 10^6
    times every other row's: the summed projections keep exactly those 6 rows (density 0.1),
    whole, and the vector whole. ||Y_a V||^2 over r = 4 Gaussian columns is ||Y_a||^2 times
    a chi-square with 4 degrees of freedom, so a wrong pick needs a weak row's draw above 60
    (probability 3e-12 each) or a strong row's below 1e-4 (1.3e-9 each, allowing for the
    rows' own spread of energy): over 5 draws of 54 weak and 6 strong rows a false failure
    has odds below 1e-7 for any seed. Rows strong on every worker but cancelling in the mean
    are not the aggregate's: they are left out (the marginal sketch, which sums energies,
    keeps them)."""
    world, rows, cols = 4, 60, 50
    generator = torch.Generator().manual_seed(3)
    strong = torch.tensor([3, 17, 18, 40, 41, 59])
    mean = torch.randn(rows, cols, generator=generator)
    mean[strong] *= 1000.0
    # Each worker: the mean plus its own part; the parts sum to zero, and rows 5-10 of them
    # are huge (they cancel in the mean).
    parts = torch.randn(world, rows, cols, generator=generator)
    parts -= parts.mean(0)
    parts[:, 5:11] *= 1e5
    workers = mean + parts
    bias = torch.randn(world, 7, generator=generator)
    flats = torch.cat([workers.reshape(world, -1), bias], dim=1)
    shapes = [(rows, cols), (7,)]
    pieces = projection_layout(shapes, flats.shape[1], 64)
    for call in range(5):  # five draws of V
        basis = projections(pieces, 4, 0, 7, call)
        sketch = sum(projection_sketch(flat, pieces, basis) for flat in flats)
        index = projection_pattern(sketch, pieces, 4, 0.1)
        expected = torch.cat([(strong[:, None] * cols + torch.arange(cols)).reshape(-1),
                              torch.arange(rows * cols, rows * cols + 7)])
        assert torch.equal(index, expected)
        # The same as the published rule on the aggregate itself: the rows of largest
        # ||mean(Y) V||^2.
        published = (aggregate_rows(workers.reshape(-1), rows, cols, world)
                     @ basis[0]).square().sum(1)
        assert torch.equal(top_coordinates(published, 6), strong)
    energies = marginal_scores(sum(marginal_sketch(flat, layout(shapes, flats.shape[1], 64))
                                   for flat in flats), layout(shapes, flats.shape[1], 64),
                               flats.shape[1])
    marginal_rows = top_coordinates(energies[: rows * cols].view(rows, cols).sum(1), 6)
    assert set(marginal_rows.tolist()) <= set(range(5, 11)), "energies count the cancelling"


def test_the_marginal_sketch_scores_a_rank_one_energy_exactly():
    """Where the energy of a weight's gradient is rank one (one sample: the outer product of
    the output error and the input), rows and columns give every coordinate's energy exactly,
    so ARC-Top-K picks the true top coordinates from a sketch of rows + cols + 1 values; a
    vector is sketched per coordinate."""
    generator = torch.Generator().manual_seed(0)
    u, v = torch.randn(30, generator=generator), torch.randn(50, generator=generator)
    bias = torch.randn(30, generator=generator)
    x = torch.cat([torch.outer(u, v).reshape(-1), bias])
    pieces = layout([(30, 50), (30,)], x.numel(), 64)
    sketch = marginal_sketch(x, pieces)
    assert sketch.numel() == 30 + 50 + 1 + 30
    torch.testing.assert_close(marginal_scores(sketch, pieces, x.numel()), x.square())
    # Summed over workers, the sketch is the sketch of the pooled energies.
    halves = marginal_sketch(x / math.sqrt(2), pieces) * 2
    torch.testing.assert_close(halves, sketch)
    k = count_of(0.05, x.numel())
    assert torch.equal(top_coordinates(marginal_scores(sketch, pieces, x.numel()), k),
                       torch.topk(x.abs(), k).indices.sort().values)


# --- over real collectives on loopback ----------------------------------------------------------


def ring_of(world: int) -> list[Ring]:
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(world)]
    addresses = [listener.address for listener in listeners]
    return run_concurrently(*(
        lambda rank=rank: Ring(rank, world, addresses=addresses, listener=listeners[rank],
                               timeout=10)
        for rank in range(world)
    ))


def lossy_of(world: int, **options) -> list[Lossy]:
    endpoints = [DatagramEndpoint(rank, 5, ("127.0.0.1", 0)) for rank in range(world)]
    listeners = [Listener(("127.0.0.1", 0)) for _ in range(world)]
    return run_concurrently(*(
        lambda rank=rank: Lossy(
            rank, world, addresses=[e.address for e in endpoints], endpoint=endpoints[rank],
            run_id=5, deadline_initial=5.0, deadline_floor=5.0,
            stream_addresses=[x.address for x in listeners], listener=listeners[rank],
            **options)
        for rank in range(world)
    ))


INNERS = {"ring": ring_of, "lossy": lossy_of}


def gradients(world: int, numel: int, step: int) -> list[torch.Tensor]:
    """Different per worker, with a shared structure (a few strong blocks) and noise."""
    shared = torch.zeros(numel)
    shared[100:164] = 5.0
    shared[numel - 300: numel - 200] = -3.0
    return [shared + torch.randn(numel, generator=torch.Generator().manual_seed(
        1000 * step + rank)) for rank in range(world)]


@pytest.mark.parametrize("sketch", ["projection", "marginal"])
@pytest.mark.parametrize("inner", ["ring", "lossy"])
def test_arc_topk_pattern_is_identical_on_every_worker(inner, sketch):
    """Four workers with different gradients and no shapes (rows of 16 values): every call
    they agree on one pattern, send its values, the sketch and the exact tail, and over an
    exact inner hold the same estimate. (Without error feedback: every call compresses.)"""
    world, numel = 4, 10_000
    workers = [wrap(c, "arc_topk", density=0.02, block=16, sketch=sketch, error_feedback=False,
                    dense_tail=1) for c in INNERS[inner](world)]
    # 9,999 values: 624 rows of 16 and a ragged end of 15.
    if sketch == "projection":  # 12 whole rows and the ragged end; 4 projections a row
        count, sketched = 12 * 16 + 15, 624 * 4
    else:  # single coordinates; every row's and column's energy, the total, the ragged end
        count, sketched = count_of(0.02, numel - 1), 624 + 16 + 1 + 15
    try:
        for step in range(4):
            inputs = gradients(world, numel, step)
            for rank in range(world):  # each worker's own strongest coordinates differ
                inputs[rank][2000 + 500 * rank: 2000 + 500 * rank + 64] += 4.0
            results = run_concurrently(*(lambda r=r, s=step, x=inputs: workers[r].allreduce(x[r], s)
                                         for r in range(world)))
            patterns = [w.compressor.last_index for w in workers]
            assert all(torch.equal(p, patterns[0]) for p in patterns), "patterns differ"
            assert patterns[0].numel() == count
            if sketch == "marginal":
                # The coordinates strong on every worker win over those strong on one.
                assert set(range(100, 164)) <= set(patterns[0].tolist())
            expected = torch.stack(inputs).mean(0)
            for result, stats in results:
                torch.testing.assert_close(result[-1], expected[-1])  # the exact tail
                assert stats.collective == f"{inner}+arc_topk"
                # Values at the agreed coordinates, the exact tail, and the sketch.
                sent = count + 1 + sketched
                assert stats.extra["compression_ratio"] == pytest.approx(sent / numel)
                assert stats.bytes_sent > 0
            if inner == "ring":  # an exact inner: every worker holds the same estimate
                assert all(torch.equal(r, results[0][0]) for r, _ in results)
    finally:
        for w in workers:
            w.close()


@pytest.mark.parametrize("sketch", ["projection", "marginal"])
def test_ef21m_with_arc_topk_keeps_the_accumulated_error_bounded(sketch):
    """EF21M around ARC-Top-K over a ring, 300 calls of drifting gradients that differ per
    worker: the first call sends them whole, then every worker sends the same coordinates,
    what each holds back (||v_i - g_i||) stays bounded, and the shared estimate g follows the
    mean gradient."""
    world, steps = 3, 300
    shapes = [(20, 50), (20,)]
    numel = 20 * 50 + 20
    workers = [wrap(c, "arc_topk", density=0.05, sketch=sketch) for c in ring_of(world)]
    for worker in workers:
        worker.set_shapes(shapes)
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(world, numel, generator=generator)
    # Projection: 1 of the 20 rows (50 values) and the vector; marginal: 5% of the values.
    count = 50 + 20 if sketch == "projection" else count_of(0.05, numel)
    residuals, gaps = [], []
    try:
        for step in range(steps):
            grads = (base * (1 + 0.5 * math.sin(step / 40))
                     + 0.1 * torch.randn(world, numel, generator=generator))
            results = run_concurrently(*(lambda r=r, s=step, x=grads: workers[r].allreduce(x[r], s)
                                         for r in range(world)))
            mean = grads.mean(0)
            if step == 0:  # EF21M's start: the gradients whole, g their exact mean
                assert all(w.compressor.last_index is None for w in workers)
                torch.testing.assert_close(results[0][0], mean)
                continue
            patterns = [w.compressor.last_index for w in workers]
            assert all(torch.equal(p, patterns[0]) for p in patterns), "patterns differ"
            assert patterns[0].numel() == count
            residuals.append(max(stats.extra["feedback_residual"] for _, stats in results))
            gaps.append(float(torch.linalg.vector_norm(results[0][0] - mean)
                              / torch.linalg.vector_norm(mean)))
    finally:
        for w in workers:
            w.close()
    early, late = max(residuals[50: steps // 2]), max(residuals[steps // 2:])
    assert late < 1.5 * early, "the held-back error keeps growing"
    assert late < 0.4 * float(torch.linalg.vector_norm(base, dim=1).max()), late
    # 5-7% of the coordinates a call, yet g stays a fair estimate of the drifting mean.
    assert max(gaps[steps // 2:]) < 0.5, max(gaps[steps // 2:])


@pytest.mark.parametrize("sketch", ["projection", "marginal"])
def test_ef14_with_arc_topk_sends_everything_in_the_end(sketch):
    """EF14 around ARC-Top-K over a ring, 200 calls of the same gradients: every call the
    workers agree on a pattern, and what they stepped on adds up to everything they computed
    less what they still hold back, exactly: sum_t result_t + mean_i e_i = T mean_i d_i (the
    recurrence telescopes); what is held back stays bounded."""
    world, calls = 3, 200
    shapes = [(20, 50), (20,)]
    numel = 20 * 50 + 20
    workers = [wrap(c, "arc_topk", density=0.05, sketch=sketch, feedback="ef14")
               for c in ring_of(world)]
    for worker in workers:
        worker.set_shapes(shapes)
    grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(2))
    total = torch.zeros(numel, dtype=torch.float64)
    residuals = []
    try:
        for step in range(calls):
            results = run_concurrently(*(lambda r=r, s=step: workers[r].allreduce(grads[r], s)
                                         for r in range(world)))
            patterns = [w.compressor.last_index for w in workers]
            assert all(torch.equal(p, patterns[0]) for p in patterns), "patterns differ"
            total += results[0][0].double()
            residuals.append(max(stats.extra["feedback_residual"] for _, stats in results))
    finally:
        for w in workers:
            w.close()
    held = torch.stack([w.compressor.feedback.error for w in workers]).double().mean(0)
    expected = calls * grads.double().mean(0)
    torch.testing.assert_close(total + held, expected, rtol=0, atol=1e-3 * calls)
    assert max(residuals[calls // 2:]) < 1.5 * max(residuals[: calls // 2])


@pytest.mark.parametrize("kind", ["topk", "randk", "arc_topk", "int8", "int4", "powersgd"])
@pytest.mark.parametrize("inner", ["ring", "lossy"])
def test_every_compressor_estimates_the_mean(kind, inner):
    """Repeated calls on the same inputs: with EF21M the sparsifiers' estimate converges to the
    true mean (from that of other inputs, which EF21M's first call sent whole); quantizers are
    close at once; PowerSGD's classic error feedback makes the mean of its results over the
    calls converge (a single call sends only the top of the accumulated error); the dense tail
    is exact; ring and lossy. Inputs and seeds are fixed: the numbers are the same every
    run."""
    world, numel = 3, 4000
    params = {"density": 0.05} if kind in ("topk", "randk", "arc_topk") else {}
    if kind == "arc_topk":
        params["block"] = 8
    if kind in ("topk", "randk", "arc_topk"):
        params["momentum"] = 1.0  # EF21: the estimate of a fixed input converges to it
    workers = [wrap(c, kind, dense_tail=1, **params) for c in INNERS[inner](world)]
    try:
        if kind in ("topk", "randk", "arc_topk"):  # EF21M's start, on other inputs
            others = gradients(world, numel, 9)
            run_concurrently(*(lambda r=r: workers[r].allreduce(others[r], 0)
                               for r in range(world)))
        inputs = gradients(world, numel, 0)
        expected = torch.stack(inputs).mean(0)
        error = math.inf
        # Rand-K reaches a coordinate at random: (1 - 0.05)^120 of them are still unsent.
        calls = {"topk": 40, "arc_topk": 40, "randk": 120, "powersgd": 120}.get(kind, 3)
        totals = torch.zeros(world, numel)
        errors = []
        for step in range(1, calls + 1):
            results = run_concurrently(*(lambda r=r, s=step, x=inputs: workers[r].allreduce(x[r], s)
                                         for r in range(world)))
            totals += torch.stack([result for result, _ in results])
            estimates = (totals / step if kind == "powersgd"
                         else torch.stack([result for result, _ in results]))
            error = max(float(torch.linalg.vector_norm(e - expected)
                              / torch.linalg.vector_norm(expected)) for e in estimates)
            errors.append(error)
        # PowerSGD's mean was 0.86 off after one call, 0.44 after 20 and 0.10 after 120.
        bound = {"int8": 0.02, "int4": 0.3, "powersgd": 0.15, "randk": 0.1}.get(kind, 0.05)
        assert error < bound, error
        if kind == "powersgd":
            assert errors[-1] < errors[19] / 2 < errors[0] / 2, errors
        for result, stats in results:
            torch.testing.assert_close(result[-1], expected[-1])
            ratio = stats.extra["compression_ratio"]
            assert 0 < ratio < (0.6 if kind != "int8" else 0.3), ratio
        if kind == "topk":
            # The all-gather carries k indices and k values per worker: exact sum of c_i.
            assert results[0][1].extra["compressed_bytes"] == 8 * count_of(0.05, numel - 1) + 4
    finally:
        for w in workers:
            w.close()


def test_int4_over_the_ring_sends_an_eighth_of_the_bytes():
    world, numel = 4, 100_000
    plain = ring_of(world)
    compressed = [wrap(c, "int4", group_size=128) for c in ring_of(world)]
    try:
        inputs = gradients(world, numel, 0)
        dense = run_concurrently(*(lambda r=r: plain[r].allreduce(inputs[r], 0)
                                   for r in range(world)))
        small = run_concurrently(*(lambda r=r: compressed[r].allreduce(inputs[r], 0)
                                   for r in range(world)))
        ratio = small[0][1].bytes_sent / dense[0][1].bytes_sent
        assert 0.12 < ratio < 0.16, ratio  # 4 of 32 bits, plus a scale per 128 values
        assert all(torch.equal(r, small[0][0]) for r, _ in small), "copies differ"
    finally:
        for w in [*plain, *compressed]:
            w.close()


def test_a_bad_compressor_is_named_with_what_is_allowed():
    ring = ring_of(1)[0]
    try:
        with pytest.raises(ValueError, match=r"compressor\.kind: expected one of none, topk"):
            wrap(ring, "top-k")
        with pytest.raises(ValueError, match=r"compressor\.block: not a parameter of int8"):
            wrap(ring, "int8", block=4)
        with pytest.raises(ValueError, match="sketch: expected one of projection, marginal"):
            wrap(ring, "arc_topk", sketch="rows")
        with pytest.raises(ValueError, match="feedback: expected one of ef21m, ef14"):
            wrap(ring, "topk", feedback="ef22")
        with pytest.raises(ValueError, match="are EF21M's"):
            wrap(ring, "randk", feedback="ef14", resync_every=3)
    finally:
        ring.close()


def test_over_lossy_a_lost_chunk_costs_its_values_and_a_resync_reunites_the_estimates():
    """Under a seeded loss of lossy's datagrams, EF21M's first call (the gradients whole)
    goes over TCP and leaves every copy of g equal; then ARC-Top-K's pattern still agrees
    (the sketch goes over TCP), every result is finite, the copies of EF21M's shared estimate
    drift apart where a worker's own value stood in for a lost mean, and `resync_every` makes
    them equal again."""
    from testbed.collectives.lossy import SeededLoss

    world, numel = 3, 20_000
    workers = [wrap(c, "arc_topk", density=0.1, block=8, resync_every=3)
               # no parity or resend: the lost chunks stay lost, so the copies of g drift
               for c in lossy_of(world, test_loss=SeededLoss(0.2, seed=4), parity=0,
                                 resend=False)]
    try:
        drifted = False
        for step in range(6):
            inputs = gradients(world, numel, step)
            results = run_concurrently(*(lambda r=r, s=step, x=inputs: workers[r].allreduce(x[r], s)
                                         for r in range(world)))
            assert all(torch.isfinite(r).all() for r, _ in results)
            shared = [w.compressor.feedback.shared for w in workers]
            same = all(torch.equal(g, shared[0]) for g in shared)
            if step == 0:
                assert same and all(w.compressor.last_index is None for w in workers)
                continue
            patterns = [w.compressor.last_index for w in workers]
            assert all(torch.equal(p, patterns[0]) for p in patterns), "patterns differ"
            assert min(stats.coverage for _, stats in results) < 1.0, "nothing was lost?"
            if (step + 1) % 3 == 0:
                assert same, "a resync leaves every copy of g equal"
            else:
                drifted |= not same
        assert drifted, "with 20% loss the copies of g should differ between resyncs"
    finally:
        for w in workers:
            w.close()


def test_powersgd_given_the_shapes_recovers_low_rank_weights_and_sends_vectors_exact():
    """One matrix per weight (as torch's hook): rank-1 weight gradients come back exact after
    one call at rank 2, biases travel uncompressed; the flat fallback cannot do that."""
    from testbed.collectives.compression.powersgd import PowerSGD

    class Local:  # one worker: the all-reduce is the identity
        @staticmethod
        def allreduce(tensor):
            return tensor.clone()

    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    shapes = [(40, 30), (30,), (10, 40), (10,)]
    parts = [torch.outer(randn(40), randn(30)), randn(30), torch.outer(randn(10), randn(40)),
             randn(10)]
    flat = torch.cat([p.reshape(-1) for p in parts])
    shaped = PowerSGD(rank=2)
    shaped.set_shapes(shapes)
    result, tail, figures = shaped.reduce(Local, flat, torch.tensor([4.0]), 0)
    torch.testing.assert_close(result, flat, rtol=1e-4, atol=1e-4)
    assert tail.tolist() == [4.0]
    assert figures["payload_bytes"] == 4 * ((40 + 30) * 2 + 30 + (10 + 40) * 2 + 10 + 1)
    unshaped, _, _ = PowerSGD(rank=2).reduce(Local, flat, torch.zeros(0), 0)
    assert torch.linalg.vector_norm(unshaped - flat) > 0.1 * torch.linalg.vector_norm(flat)
