"""Data-parallel training over an in-process exact average equals single-process training on
the union of the workers' batches; DropCompute's weighting is exact; stragglers and DropCompute
on fake clocks (no sleeping); the strategies agree where they must."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from testbed.collectives.base import AllReduceStats, Collective
from testbed.train.config import TrainConfig
from testbed.train.data import Shard
from testbed.train.dropcompute import pack, unpack
from testbed.train.job import Job, StepRecord, load_dataset, summarize_steps, train
from testbed.train.models import build_model, loss_fn
from testbed.train.strategies import build_optimizer

torch.set_num_threads(1)

# A small char-lm needs no scikit-learn and steps in milliseconds.
TINY_LM = {"model": "char-lm", "context": 8, "corpus_chars": 20_000}
MODELS = [
    pytest.param({"model": "mlp"}, id="mlp"),
    pytest.param(TINY_LM, id="char-lm"),
]


class FakeClock:
    """Test helper: time that moves only when the job sleeps or waits for a slower peer."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += seconds

    def advance_to(self, time: float) -> None:
        self.time = max(self.time, time)


class InProcessGroup:
    """Test helper: `world` threads of one process that swap values through shared slots. With
    clocks, every all-reduce first moves each worker's fake clock to the latest one, which is
    what blocking on the slowest peer does to real time."""

    def __init__(self, world: int, clocks: list[FakeClock] | None = None) -> None:
        self.world = world
        self.clocks = clocks
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values

    def sync_clock(self, rank: int) -> None:
        if self.clocks is not None:
            times = self.exchange(rank, self.clocks[rank].now())
            self.clocks[rank].advance_to(max(times))


class InProcessExactAverage:
    """Test helper: an exact all-reduce (mean) among the threads of an `InProcessGroup`."""

    name = "in-process-exact"

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world = group.world

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        self.group.sync_clock(self.rank)
        values = self.group.exchange(self.rank, tensor.clone())
        return torch.stack(values).mean(0), AllReduceStats(self.name, step)

    def close(self) -> None:
        pass


class InProcessShardedStep(InProcessExactAverage):
    """Test helper: a collective that owns the update, as the lossy all-reduce does: worker r
    owns the r-th contiguous slice, updates it with the averaged gradient, and all gather."""

    def step(
        self,
        parameters: torch.Tensor,
        gradient: torch.Tensor,
        step: int,
        update: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, AllReduceStats]:
        mean, stats = self.allreduce(gradient, step)
        sizes = [len(part) for part in parameters.tensor_split(self.world)]
        start = sum(sizes[: self.rank])
        end = start + sizes[self.rank]
        mine = update(start, parameters[start:end], mean[start:end])
        return torch.cat(self.group.exchange(self.rank, mine)), stats


def run_workers(
    world: int,
    work: Callable[[int, Collective], Any],
    collective: type[InProcessExactAverage] = InProcessExactAverage,
    clocks: list[FakeClock] | None = None,
) -> list[Any]:
    """Run `work(rank, collective)` on `world` threads; one failure breaks the others' barrier."""
    group = InProcessGroup(world, clocks)

    def run(rank: int) -> Any:
        try:
            return work(rank, collective(group, rank))
        except BaseException:
            group.barrier.abort()
            raise

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(run, range(world)))


def run_jobs(
    configs: list[TrainConfig],
    collective: type[InProcessExactAverage] = InProcessExactAverage,
    clocks: list[FakeClock] | None = None,
) -> list[tuple[Job, list[StepRecord]]]:
    """Each worker runs its config's steps; returns its job and records."""
    world = len(configs)

    def work(rank: int, link: Collective) -> tuple[Job, list[StepRecord]]:
        clock = clocks[rank] if clocks else None
        job = Job(configs[rank], link, rank, world, clock)
        return job, [job.step(step) for step in range(configs[rank].steps)]

    return run_workers(world, work, collective, clocks)


def flat(job_or_model: Any) -> torch.Tensor:
    model = getattr(job_or_model, "model", job_or_model)
    return parameters_to_vector(model.parameters()).detach()


def large_batch_reference(config: TrainConfig, world: int, kept: list[int] | None = None):
    """Single-process training: each step, one batch made of every worker's computed
    micro-batches (all of them unless `kept[rank]` says how many)."""
    data = load_dataset(config)
    model = build_model(config.model, data, config.context, config.seed)
    optimizer = build_optimizer(config.optimizer, list(model.parameters()))
    shards = [Shard(len(data.train_y), rank, world, config.seed) for rank in range(world)]
    micro = config.batch // config.micro_batches
    kept = kept or [config.micro_batches] * world
    for step in range(config.steps):
        indices = torch.cat(
            [shard.batch(step, config.batch)[: kept[r] * micro] for r, shard in enumerate(shards)]
        )
        optimizer.zero_grad()
        loss_fn(model(data.train_x[indices]), data.train_y[indices]).backward()
        optimizer.step()
    return model


SGD = {"sgd": {"lr": 0.5, "momentum": 0.9}}


# Adam scales every element's step to about lr, so gradients that are zero in exact arithmetic
# (the attention key bias: softmax ignores a constant added to a row) turn rounding noise of
# differently ordered sums into full steps; the transformer is checked with SGD.
@pytest.mark.parametrize(
    ("model", "optimizer"),
    [
        pytest.param({"model": "mlp"}, SGD, id="mlp-sgd"),
        pytest.param({"model": "mlp"}, {"adam": {"lr": 0.01}}, id="mlp-adam"),
        pytest.param(TINY_LM, SGD, id="char-lm-sgd"),
    ],
)
def test_data_parallel_equals_large_batch_training(model, optimizer):
    world = 3
    config = TrainConfig.parse(model, steps=4, batch=8, micro_batches=2, optimizer=optimizer)
    results = run_jobs([config] * world)
    reference = flat(large_batch_reference(config, world))
    for job, _ in results:
        torch.testing.assert_close(flat(job), reference, rtol=1e-5, atol=1e-5)
    initial = build_model(config.model, results[0][0].data, config.context, config.seed)
    assert not torch.equal(reference, flat(initial))


def test_dropcompute_payload_is_the_mean_over_all_computed_micro_batches():
    generator = torch.Generator().manual_seed(1)
    counts = [5, 1, 3]
    grads = [torch.randn(count, 7, generator=generator) for count in counts]

    def work(rank: int, link: Collective) -> torch.Tensor:
        mean, _ = link.allreduce(pack(grads[rank].sum(0), counts[rank]), step=0)
        return unpack(mean)

    for result in run_workers(len(counts), work):
        torch.testing.assert_close(result, torch.cat(grads).mean(0), rtol=1e-6, atol=1e-6)


def test_dropcompute_step_equals_training_on_the_computed_micro_batches():
    # Rank 1 injects 40 ms per step, 10 ms per micro-batch: with a 15 ms threshold it starts
    # micro-batches at 0 and 10 ms and then stops; rank 0 takes no time and computes all 4.
    common = dict(TINY_LM, steps=2, batch=8, micro_batches=4, drop_compute={"threshold": "15ms"})
    configs = [
        TrainConfig.parse(common),
        TrainConfig.parse(common, straggler={"fixed": "40ms"}),
    ]
    results = run_jobs(configs, clocks=[FakeClock(), FakeClock()])
    assert [r.micro_batches for r in results[1][1]] == [2, 2]
    assert [r.micro_batches_dropped for r in results[1][1]] == [2, 2]
    assert [r.micro_batches for r in results[0][1]] == [4, 4]
    assert results[1][1][0].injected_delay_seconds == pytest.approx(0.02)
    reference = flat(large_batch_reference(configs[0], 2, kept=[4, 2]))
    for job, _ in results:
        torch.testing.assert_close(flat(job), reference, rtol=1e-5, atol=1e-5)


def test_auto_threshold_is_shared_meets_its_target_and_beats_the_synchronous_baseline():
    world, steps, warmup = 3, 40, 8
    common = dict(TINY_LM, steps=steps, batch=8, micro_batches=4, seed=3)
    straggler = {"lognormal": {"median": "20ms", "sigma": 0.8}}
    auto = {"threshold": "auto", "target_drop_rate": "20%", "warmup_steps": warmup}

    def run(drop_compute: dict | None) -> list[list[StepRecord]]:
        configs = [
            TrainConfig.parse(common, straggler=straggler, drop_compute=drop_compute)
            for _ in range(world)
        ]
        results = run_jobs(configs, clocks=[FakeClock() for _ in range(world)])
        return [records for _, records in results]

    dropping, baseline = run(auto), run(None)
    thresholds = {records[warmup - 1].threshold_seconds for records in dropping}
    assert len(thresholds) == 1 and 0 < thresholds.pop() < float("inf")
    assert all(r.threshold_seconds is None for records in dropping for r in records[: warmup - 1])
    assert all(r.micro_batches_dropped == 0 for records in dropping for r in records[:warmup])
    after = summarize_steps(r for records in dropping for r in records[warmup:])
    before = summarize_steps(r for records in baseline for r in records[warmup:])
    assert 0.1 <= after.drop_rate <= 0.3
    assert before.drop_rate == 0
    assert after.speedup_over(before) > 1.1
    # On the fake clock the only compute time is the injected delay: every worker's steps last
    # as long as the slowest worker's compute, and the others wait for it.
    for step in range(warmup, steps):
        slowest = max(records[step].compute_seconds for records in baseline)
        for records in baseline:
            assert records[step].step_seconds == pytest.approx(slowest)
            assert records[step].wait_seconds == pytest.approx(
                slowest - records[step].compute_seconds
            )


@pytest.mark.parametrize("model", MODELS)
def test_sharded_update_equals_gradient_all_reduce(model):
    base = dict(model, steps=3, batch=8, optimizer={"adam": {"lr": 0.01}})
    gradient = run_jobs([TrainConfig.parse(base)] * 2)
    sharded = run_jobs([TrainConfig.parse(base, strategy="sharded")] * 2, InProcessShardedStep)
    for (job, _), (reference, _) in zip(sharded, gradient, strict=True):
        torch.testing.assert_close(flat(job), flat(reference), rtol=1e-6, atol=1e-6)


def test_sharded_strategy_needs_a_collective_that_owns_the_update():
    def work(rank: int, link: Collective) -> None:
        Job(TrainConfig.parse(TINY_LM, strategy="sharded"), link, rank, 1)

    with pytest.raises(ValueError, match="has no step"):
        run_workers(1, work)


def test_parameter_averaging_every_step_equals_gradient_averaging_for_plain_sgd():
    base = dict(TINY_LM, steps=3, batch=8, optimizer={"sgd": {"lr": 0.3}})
    averaged = run_jobs([TrainConfig.parse(base, strategy="average")] * 2)
    gradient = run_jobs([TrainConfig.parse(base)] * 2)
    torch.testing.assert_close(flat(averaged[0][0]), flat(gradient[0][0]), rtol=1e-5, atol=1e-6)


def test_local_steps_use_the_collective_only_every_average_every_steps():
    config = TrainConfig.parse(TINY_LM, steps=4, batch=8, strategy="average", average_every=2)
    results = run_jobs([config] * 2)
    for _, records in results:
        assert [r.stats is not None for r in records] == [False, True, False, True]
    torch.testing.assert_close(flat(results[0][0]), flat(results[1][0]), rtol=0, atol=0)


def test_train_hands_every_step_to_on_step_and_evaluates():
    config = TrainConfig.parse(TINY_LM, steps=4, batch=8, eval_every=2, eval_samples=16)
    seen: list[StepRecord] = []

    def work(rank: int, link: Collective):
        return train(config, link, rank, 1, on_step=seen.append)

    (result,) = run_workers(1, work)
    assert [r.step for r in seen] == [0, 1, 2, 3]
    assert seen == result.records
    assert set(seen[1].evaluation) == {"loss", "accuracy", "perplexity"}
    assert not seen[0].evaluation
    assert result.evaluation == seen[3].evaluation
    assert all(r.stats is not None and r.stats.step == r.step for r in seen)
    assert result.summary.steps == 4 and result.summary.drop_rate == 0


def test_job_rejects_a_collective_of_another_rank():
    def work(rank: int, link: Collective) -> None:
        Job(TrainConfig.parse(TINY_LM), link, rank=1, world=2)

    with pytest.raises(ValueError, match="rank 0 of 1"):
        run_workers(1, work)


def test_injected_delay_really_sleeps_on_the_system_clock():
    config = TrainConfig.parse(
        TINY_LM, steps=2, batch=8, micro_batches=2, straggler={"fixed": "2ms"}
    )
    (result,) = run_workers(1, lambda rank, link: train(config, link, rank, 1))
    for record in result.records:
        assert record.injected_delay_seconds == pytest.approx(0.002)
        assert record.compute_seconds >= 0.002


class TickingClock(FakeClock):
    """Every look at the clock finds it 10 ms later: compute that takes time of its own."""

    def now(self) -> float:
        self.time += 0.01
        return self.time


def test_a_slow_machine_stretches_compute_and_a_burst_adds_its_delay():
    config = TrainConfig.parse(TINY_LM, steps=1, batch=8, micro_batches=2)

    def compute(slowdown: float, burst: float) -> StepRecord:
        def work(rank: int, link: Collective) -> StepRecord:
            return Job(config, link, rank, 1, clock=TickingClock(), slowdown=slowdown).step(
                0, extra_delay=burst)
        return run_workers(1, work)[0]

    plain, slow, burst = compute(1.0, 0.0), compute(3.0, 0.0), compute(1.0, 0.5)
    # Each of the two micro-batches takes one 10 ms tick; three times as slow adds two more each.
    assert slow.compute_seconds - plain.compute_seconds == pytest.approx(2 * 2 * 0.01)
    assert slow.injected_delay_seconds == 0.0
    assert burst.compute_seconds - plain.compute_seconds == pytest.approx(0.5)
    assert burst.injected_delay_seconds == pytest.approx(0.5)


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown: expected at least 1"):
        run_workers(1, lambda rank, link: Job(TrainConfig.parse(TINY_LM), link, rank, 1,
                                              slowdown=0.5))
