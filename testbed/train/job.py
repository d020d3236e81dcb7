"""The training job one worker runs: its data shard, the model, injected straggler delay,
DropCompute, and a strategy that combines the workers' work over a collective.

`train(config, collective, rank, world, on_step=...)` runs it and hands every step's
`StepRecord` to `on_step` (the metrics and report layers). Time comes from a `Clock`, so tests
can run stragglers and DropCompute on a fake clock without sleeping.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from testbed.collectives.base import AllReduceStats, Collective
from testbed.train.config import TrainConfig
from testbed.train.data import Dataset, Shard, characters, digits
from testbed.train.diloco import DiLoCo
from testbed.train.dropcompute import DropCompute
from testbed.train.models import build_model, evaluate, loss_fn
from testbed.train.stragglers import StragglerDelay
from testbed.train.strategies import (
    GradientAllReduce,
    ParameterAveraging,
    ShardedUpdate,
    Strategy,
)


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    def sleep(self, seconds: float) -> None:
        """Spend `seconds` (the injected straggler delay)."""
        ...


class SystemClock:
    """Real time: the injected delay really sleeps, which is the straggler feature."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass
class StepRecord:
    """What one worker's step did. `wait_seconds` is the time after compute: the collective
    (waiting for slower peers, then communicating) and the optimizer update; `stats` is None on
    steps that did not use the collective (local steps of strategy average)."""

    rank: int
    step: int
    loss: float
    compute_seconds: float
    wait_seconds: float
    step_seconds: float
    injected_delay_seconds: float
    micro_batches: int
    micro_batches_dropped: int
    threshold_seconds: float | None
    stats: AllReduceStats | None
    evaluation: dict[str, float] = field(default_factory=dict)


@dataclass
class RunSummary:
    """Means over steps (and workers) of a run, to set DropCompute against its baseline."""

    steps: int
    drop_rate: float
    step_seconds: float
    compute_seconds: float
    wait_seconds: float

    def speedup_over(self, baseline: RunSummary) -> float:
        """How many times faster a step is than in `baseline` (e.g. the same run without
        DropCompute, measured side by side)."""
        return baseline.step_seconds / self.step_seconds


def summarize_steps(records: Iterable[StepRecord]) -> RunSummary:
    records = list(records)
    computed = sum(r.micro_batches for r in records)
    dropped = sum(r.micro_batches_dropped for r in records)
    count = len(records)
    return RunSummary(
        steps=count,
        drop_rate=dropped / (computed + dropped),
        step_seconds=sum(r.step_seconds for r in records) / count,
        compute_seconds=sum(r.compute_seconds for r in records) / count,
        wait_seconds=sum(r.wait_seconds for r in records) / count,
    )


@dataclass
class TrainResult:
    records: list[StepRecord]
    evaluation: dict[str, float]

    @property
    def summary(self) -> RunSummary:
        return summarize_steps(self.records)


def make_strategy(config: TrainConfig, collective: Collective, model: nn.Module) -> Strategy:
    """The strategy the job's `strategy` names (`strategies`, `diloco`)."""
    if config.strategy == "average":
        return ParameterAveraging(collective, model, config.optimizer, config.average_every)
    if config.strategy == "sharded":
        return ShardedUpdate(collective, model, config.optimizer)
    if config.strategy == "diloco":
        return DiLoCo(collective, model, config)
    return GradientAllReduce(collective, model, config.optimizer)


def load_dataset(config: TrainConfig) -> Dataset:
    if config.model == "char-lm":
        return characters(config.context, config.corpus_chars)
    return digits()


def job_device(config: TrainConfig, rank: int) -> torch.device:
    """Where worker `rank` trains: the CPU, or with `device: cuda` GPU `rank` mod the GPUs it
    sees (several workers share one where there are more workers than GPUs)."""
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("job.device: cuda, but torch.cuda.is_available() is False on this host "
                         "(no GPU, no driver, or a torch built without CUDA); use device: cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def on_device(data: Dataset, device: torch.device) -> Dataset:
    """`data` with its tensors on `device` (the same tensors where they are there already)."""
    return dataclasses.replace(
        data, **{name: getattr(data, name).to(device)
                 for name in ("train_x", "train_y", "test_x", "test_y")})


class Job:
    """One worker's end of data-parallel training; `step(n)` runs step n."""

    def __init__(
        self,
        config: TrainConfig,
        collective: Collective,
        rank: int,
        world: int,
        clock: Clock | None = None,
        slowdown: float = 1.0,
    ) -> None:
        if slowdown < 1:
            raise ValueError(f"slowdown: expected at least 1 (1: full speed), got {slowdown}")
        if (collective.rank, collective.world) != (rank, world):
            raise ValueError(
                f"collective is rank {collective.rank} of {collective.world}, "
                f"the job was given rank {rank} of {world}"
            )
        torch.set_num_threads(config.threads)
        self.config = config
        self.collective = collective
        self.rank = rank
        self.clock = clock or SystemClock()
        self.slowdown = slowdown
        self.device = job_device(config, rank)
        self.data = on_device(load_dataset(config), self.device)
        self.shard = Shard(len(self.data.train_y), rank, world, config.seed)
        self.model = build_model(config.model, self.data, config.context, config.seed,
                                 config.width, config.layers).to(self.device)
        self.parameters = list(self.model.parameters())
        self.strategy = make_strategy(config, collective, self.model)
        self.delay = (
            StragglerDelay(config.straggler, config.seed, rank) if config.straggler else None
        )
        self.drop = (
            DropCompute(config.drop_compute, config.micro_batches, rank, world)
            if config.drop_compute
            else None
        )

    def step(self, step: int, extra_delay: float = 0.0) -> StepRecord:
        """Run step `step`; `extra_delay`: seconds of injected delay on top of the worker's own
        straggler draw (a straggler burst from the fault timeline)."""
        config, clock = self.config, self.clock
        start = clock.now()
        injected = (self.delay.next() if self.delay else 0.0) + extra_delay
        delay_share = injected / config.micro_batches
        for parameter in self.parameters:
            parameter.grad = None
        losses: list[float] = []
        starts: list[float] = []
        for micro in self.shard.batch(step, config.batch).chunk(config.micro_batches):
            began = clock.now()
            starts.append(began - start)
            loss = loss_fn(self.model(self.data.train_x[micro]), self.data.train_y[micro])
            loss.backward()
            losses.append(loss.item())
            # A slow machine takes `slowdown` times as long for the same work.
            clock.sleep(delay_share + (self.slowdown - 1) * (clock.now() - began))
            if self.drop is not None and self.drop.stop(clock.now() - start):
                break
        compute_end = clock.now()
        computed = len(losses)
        gradient_sum = parameters_to_vector([p.grad for p in self.parameters])
        stats = self.strategy.apply(gradient_sum, computed, step)
        if self.drop is not None:
            self.drop.observe(starts, step, self.collective)
        end = clock.now()
        return StepRecord(
            rank=self.rank,
            step=step,
            loss=sum(losses) / computed,
            compute_seconds=compute_end - start,
            wait_seconds=end - compute_end,
            step_seconds=end - start,
            injected_delay_seconds=delay_share * computed,
            micro_batches=computed,
            micro_batches_dropped=config.micro_batches - computed,
            threshold_seconds=self.drop.threshold if self.drop else None,
            stats=stats,
        )

    def state(self) -> torch.Tensor:
        """What a rejoining worker takes from a live one (flat, on the host: it travels through
        the run's store): DiLoCo's outer state, else the parameters."""
        if isinstance(self.strategy, DiLoCo):
            return self.strategy.state()
        return parameters_to_vector(self.parameters).detach().cpu()

    def restore(self, state: torch.Tensor) -> None:
        """Take another worker's `state()` (as sent: float32)."""
        if isinstance(self.strategy, DiLoCo):
            self.strategy.restore(state)
        else:
            vector_to_parameters(state.to(self.parameters[0]), self.parameters)

    @property
    def state_is_parameters(self) -> bool:
        """Whether `state()` is the parameters, which a collective may hand a rejoining worker
        itself (Moshpit's `pull_state`); DiLoCo's outer state comes only from a live worker."""
        return not isinstance(self.strategy, DiLoCo)

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.model, self.data, self.config.eval_samples)


def train(
    config: TrainConfig,
    collective: Collective,
    rank: int,
    world: int,
    on_step: Callable[[StepRecord], None] | None = None,
    clock: Clock | None = None,
) -> TrainResult:
    """Run `config.steps` steps as worker `rank` of `world`; evaluate every `eval_every` steps
    (into that step's record) and at the end."""
    job = Job(config, collective, rank, world, clock)
    records = []
    for step in range(config.steps):
        record = job.step(step)
        if config.eval_every and (step + 1) % config.eval_every == 0:
            record.evaluation = job.evaluate()
        records.append(record)
        if on_step is not None:
            on_step(record)
    return TrainResult(records, records[-1].evaluation or job.evaluate())
