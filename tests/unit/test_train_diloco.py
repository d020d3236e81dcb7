"""Strategy diloco: the outer step is SGD with Nesterov momentum on the mean pseudo-gradient,
the pseudo-gradients go through the collective once per H steps (Streaming DiLoCo: each
fragment once per H steps at its offset), an overlapped all-reduce that is back at once never
makes the inner loop wait, the outer state a restarted worker takes round-trips, and bad option
combinations name their field."""

from __future__ import annotations

import threading

import pytest
import torch
from test_train_job import TINY_LM, InProcessExactAverage, flat, run_jobs, run_workers
from torch import nn

from testbed.collectives.base import AllReduceStats
from testbed.metrics import WorkerMetrics
from testbed.report.events import step_fields
from testbed.scenario import ScenarioError, load_scenario
from testbed.train.config import TrainConfig, TrainConfigError
from testbed.train.diloco import DiLoCo, fragment_ranges
from testbed.train.job import Job

torch.set_num_threads(1)

DILOCO = dict(TINY_LM, batch=8, strategy="diloco")


class Counting(InProcessExactAverage):
    """Test helper: the exact in-process mean, recording each call's (step, size)."""

    def __init__(self, group, rank: int) -> None:
        super().__init__(group, rank)
        self.calls: list[tuple[int, int]] = []

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        self.calls.append((step, tensor.numel()))
        return super().allreduce(tensor, step)


class Scripted:
    """Test helper: one worker whose peer's pseudo-gradient is `other`: the mean of the two,
    returned at once."""

    name, rank, world = "scripted", 0, 1

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        self.calls += 1
        return (tensor + self.other) / 2, AllReduceStats(self.name, step, bytes_sent=8)

    def close(self) -> None:
        pass


def test_the_outer_step_is_the_hand_computed_nesterov_update():
    # Values, rates and momentum with few binary digits: every operation is exact, whatever
    # the order or fusion of torch's kernels, so the comparison can be exact too.
    model = nn.Linear(2, 1)  # three parameters: weight (1, 2) and bias (1,)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        model.bias.copy_(torch.tensor([0.125]))
    start = torch.tensor([0.5, -0.25, 0.125])
    other = torch.tensor([0.25, -0.5, 0.125])
    collective = Scripted(other)
    lr, momentum = 0.5, 0.75
    config = TrainConfig.parse(DILOCO, steps=4, inner_steps=2, optimizer={"sgd": {"lr": 0.5}},
                               outer={"lr": lr, "momentum": momentum, "nesterov": True})
    strategy = DiLoCo(collective, model, config)
    gradients = [torch.tensor(g) for g in ([1.0, 2.0, -1.0], [0.5, -1.0, 2.0],
                                           [-2.0, 0.25, 1.0], [1.5, 1.0, -0.5])]
    synced, local, buffer = start.clone(), start.clone(), None
    for step, gradient in enumerate(gradients):
        stats = strategy.apply(gradient, 1, step)
        local = local - 0.5 * gradient  # the inner SGD step
        if step % 2 == 0:
            assert stats is None
            continue
        mean = ((synced - local) + other) / 2  # the workers' mean pseudo-gradient
        buffer = mean if buffer is None else momentum * buffer + mean
        synced = synced - lr * (mean + momentum * buffer)  # Nesterov
        local = synced.clone()
        assert torch.equal(flat(model), synced)
        assert stats.extra["outer_step"] == (step + 1) // 2
        assert stats.extra["pseudo_gradient_norm"] == pytest.approx(float(mean.norm()))
        assert stats.extra["outer_wait_seconds"] >= 0
    assert collective.calls == 2


def test_pseudo_gradients_go_through_the_collective_once_per_inner_steps():
    config = TrainConfig.parse(DILOCO, steps=9, inner_steps=3)
    links: list[Counting] = []
    lock = threading.Lock()

    def counting(group, rank):
        link = Counting(group, rank)
        with lock:
            links.append(link)
        return link

    results = run_jobs([config] * 2, collective=counting)
    size = flat(results[0][0]).numel()
    for link in links:
        assert link.calls == [(2, size), (5, size), (8, size)]
    for _, records in results:
        assert [r.step for r in records if r.stats is not None] == [2, 5, 8]
        assert [r.stats.extra["outer_step"] for r in records if r.stats] == [1, 2, 3]
    # An exact mean and the same outer step: the workers end each H steps on the same model.
    torch.testing.assert_close(flat(results[0][0]), flat(results[1][0]), rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_streaming_sends_each_fragment_once_per_inner_steps_at_its_offset(overlap):
    config = TrainConfig.parse(DILOCO, steps=12, inner_steps=6,
                               streaming={"fragments": 3, "overlap": overlap})

    def work(rank, link):
        job = Job(config, link, rank, 1)
        records = [job.step(step) for step in range(config.steps)]
        return job, records, link.calls

    job, records, calls = run_workers(1, work, collective=Counting)[0]
    sizes = [p.numel() for p in job.parameters]
    fragments = [sum(sizes[i] for i in tensors) for tensors in fragment_ranges(sizes, 3)]
    # Offsets 0, 2 and 4 of H = 6: fragment 1 after steps 2 and 8 (counted from 1), ...
    assert calls == [(1, fragments[1]), (3, fragments[2]), (5, fragments[0]),
                     (7, fragments[1]), (9, fragments[2]), (11, fragments[0])]
    assert records[-1].stats is not None
    assert records[-1].stats.extra["outer_step"] == 6  # every call applied by the end


def test_overlapped_inner_steps_never_wait_for_an_all_reduce_that_returns_at_once():
    config = TrainConfig.parse(DILOCO, steps=24, inner_steps=4,
                               streaming={"fragments": 2, "overlap": True, "mixing": 0.5})

    def work(rank, link):
        job = Job(config, link, rank, 1)
        return [job.step(step) for step in range(config.steps)]

    records = run_workers(1, work)[0]
    outer = [r.stats.extra for r in records if r.stats is not None]
    assert sum(figures["outer_updates"] for figures in outer) == 12  # 24 / 4 x 2 fragments
    assert all(figures["outer_wait_seconds"] == 0.0 for figures in outer)
    assert {figures["fragment"] for figures in outer} == {0.0, 1.0}


def test_fragments_are_consecutive_about_equal_and_never_empty():
    assert fragment_ranges([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert fragment_ranges([100, 1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert fragment_ranges([1, 1, 100, 1, 1], 2) == [range(0, 3), range(3, 5)]
    assert fragment_ranges([5], 1) == [range(0, 1)]
    with pytest.raises(ValueError, match=r"streaming\.fragments"):
        fragment_ranges([1, 2, 3], 4)


def test_a_restarted_worker_rejoins_with_the_same_outer_state():
    config = TrainConfig.parse(DILOCO, steps=6, inner_steps=2,
                               streaming={"fragments": 2})
    (live, _), _ = run_jobs([config] * 2)
    state = live.state()
    # As the run's store carries it: float32 bytes.
    sent = torch.frombuffer(bytearray(state.to(torch.float32).numpy().tobytes()),
                            dtype=torch.float32)

    def rejoin(rank, link):
        job = Job(config, link, rank, 1)
        job.restore(sent)
        return job

    restarted = run_workers(1, rejoin)[0]
    assert torch.equal(restarted.state(), state)
    assert restarted.strategy.outer_steps == live.strategy.outer_steps == 6
    size = flat(live).numel()
    synced, momentum = state[:size], state[size:-1]
    assert torch.equal(flat(restarted), synced)  # it starts from the synced parameters
    assert momentum.abs().sum() > 0


def test_other_strategies_hand_over_their_parameters():
    config = TrainConfig.parse(TINY_LM, steps=2, batch=8)
    (job, _), = run_jobs([config])
    assert job.state_is_parameters
    assert torch.equal(job.state(), flat(job))


@pytest.mark.parametrize(("fields", "named"), [
    ({"inner_steps": 0}, "inner_steps"),
    ({"inner_steps": 30}, "inner_steps: 30 is more than steps"),
    ({"strategy": "average", "inner_steps": 5}, "inner_steps: applies to strategy: diloco"),
    ({"strategy": "gradient", "streaming": {"fragments": 2}}, "streaming: applies to"),
    ({"streaming": {"fragments": 6}}, "streaming.fragments: 6 is more than inner_steps"),
    ({"streaming": {"fragments": 2, "mixing": 0.5}}, "mixing applies to overlap: true"),
    ({"streaming": {"fragments": 2, "overlap": True, "mixing": 1.0}}, "mixing"),
    ({"streaming": {"fragments": 0}}, "fragments"),
    ({"outer": {"momentum": 0.0}}, "nesterov: needs momentum"),
    ({"outer": {"name": "adam"}}, "name"),
    ({"micro_batches": 2, "drop_compute": {"threshold": "10ms"}}, "drop_compute"),
])
def test_bad_option_combinations_name_the_field(fields, named):
    with pytest.raises(TrainConfigError, match=named):
        TrainConfig.parse(DILOCO, **{"steps": 20, "inner_steps": 5, **fields})


def test_more_fragments_than_parameter_tensors_names_the_field():
    config = TrainConfig.parse(model="mlp", strategy="diloco", steps=10, inner_steps=10,
                               streaming={"fragments": 5})  # the MLP has 4 tensors

    def work(rank, link):
        Job(config, link, rank, 1)

    with pytest.raises(ValueError, match=r"streaming\.fragments: expected 1 to the model's 4"):
        run_workers(1, work)


def test_the_default_inner_optimizer_is_adamw_and_the_outer_nesterov_sgd():
    config = TrainConfig.parse(DILOCO)
    assert config.optimizer.name == "adamw" and config.inner_steps == 50
    assert config.outer.options() == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert TrainConfig.parse(DILOCO, optimizer={"sgd": {"lr": 0.1}}).optimizer.name \
        == "sgd"


SCENARIO = """\
name: x
workers: 2
job: {{model: mlp, steps: 20, strategy: diloco, inner_steps: 5, streaming: {{fragments: 2}}}}
collective: {{kind: ring, compressor: {{kind: {compressor}}}}}
"""


def test_streaming_takes_the_quantizers_and_names_a_compressor_that_keeps_state():
    assert load_scenario(SCENARIO.format(compressor="int4")).job.streaming.fragments == 2
    with pytest.raises(ScenarioError) as caught:
        load_scenario(SCENARIO.format(compressor="powersgd"))
    [problem] = caught.value.problems
    assert problem.path == "collective.compressor.kind"
    assert "use none, int8, int4" in problem.message


def test_outer_figures_reach_the_step_event_and_the_metrics():
    config = TrainConfig.parse(DILOCO, steps=4, inner_steps=2)
    (_, records), = run_jobs([config])
    outer = records[1]
    fields = step_fields(outer)
    assert fields["outer_step"] == 1.0 and fields["outer_wait_seconds"] >= 0
    assert "outer_step" not in step_fields(records[0])
    metrics = WorkerMetrics(0, namespace_proc=False)
    for record in records:
        metrics.record_step(record)
    value = metrics.registry.get_sample_value
    assert value("testbed_outer_steps_total", {"rank": "0"}) == 2
    assert value("testbed_outer_wait_seconds_count", {"rank": "0"}) == 2
    assert value("testbed_pseudo_gradient_norm", {"rank": "0"}) == pytest.approx(
        records[3].stats.extra["pseudo_gradient_norm"])
    assert value("testbed_collective_figure", {"rank": "0", "collective": "in-process-exact",
                                               "figure": "outer_step"}) is None
