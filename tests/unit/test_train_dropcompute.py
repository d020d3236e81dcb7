"""DropCompute's automatic threshold meets its target drop rate, and the job configuration
refuses combinations that cannot work, naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.train.config import TrainConfig, TrainConfigError
from testbed.train.dropcompute import BIN_EDGES, auto_threshold, start_histogram


def start_times(steps: int, micro_batches: int, seed: int) -> np.ndarray:
    """Synthetic compute: lognormal micro-batch times, a straggling worker now and then."""
    rng = np.random.default_rng(seed)
    durations = rng.lognormal(np.log(0.01), 0.4, size=(steps, micro_batches))
    durations *= np.where(rng.random((steps, 1)) < 0.1, 5.0, 1.0)
    return np.cumsum(durations, axis=1) - durations  # when each micro-batch would start


def drop_rate(starts: np.ndarray, threshold: float) -> float:
    return float(np.mean(starts >= threshold))


@pytest.mark.parametrize("target", [0.05, 0.1, 0.25])
def test_auto_threshold_drops_at_most_the_target_and_within_a_bin_of_it(target):
    starts = start_times(400, 8, seed=1)
    threshold = auto_threshold(start_histogram(starts), target)
    assert drop_rate(starts, threshold) <= target
    # One bin lower would drop more than the target: tau is as small as the bins allow.
    lower = BIN_EDGES[np.searchsorted(BIN_EDGES, threshold) - 1]
    assert drop_rate(starts, lower) > target
    assert threshold / lower < 1.02


@pytest.mark.parametrize("target", [0.05, 0.1, 0.25])
def test_auto_threshold_meets_its_target_on_later_steps(target):
    threshold = auto_threshold(start_histogram(start_times(400, 8, seed=1)), target)
    assert drop_rate(start_times(4000, 8, seed=2), threshold) == pytest.approx(target, abs=0.02)


def test_the_mean_of_workers_histograms_pools_their_start_times():
    workers = [start_times(100, 8, seed=seed) * (1 + seed) for seed in range(3)]
    mean = np.mean([start_histogram(w) for w in workers], axis=0)
    pooled = np.concatenate([w.ravel() for w in workers])
    assert auto_threshold(mean, 0.2) == auto_threshold(start_histogram(pooled), 0.2)
    # The slowest worker (seed 2, three times slower) is the one that drops.
    threshold = auto_threshold(mean, 0.2)
    assert drop_rate(workers[2], threshold) > 2 * drop_rate(workers[0], threshold)


def test_auto_threshold_keeps_ties_together_and_never_drops_more_than_the_target():
    starts = np.array([0.0] * 4 + [0.01] * 4 + [0.02] * 4)
    # A quarter would split the 0.02s in the middle: all of them stay in, nothing fits.
    assert auto_threshold(start_histogram(starts), 0.25) == math.inf
    threshold = auto_threshold(start_histogram(starts), 0.34)
    assert 0.01 < threshold <= 0.02 and drop_rate(starts, threshold) == pytest.approx(1 / 3)
    assert auto_threshold(start_histogram(starts), 0.0) == math.inf
    assert auto_threshold(np.zeros(BIN_EDGES.size), 0.2) == math.inf


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"drop_compute": {"threshold": "soon"}}, "drop_compute.threshold", "'auto' or a duration"),
        ({"drop_compute": {"threshold": 0}}, "drop_compute", "positive duration"),
        (
            {"drop_compute": {"threshold": "5ms", "target_drop_rate": "10%"}},
            "drop_compute",
            "threshold: auto only",
        ),
        (
            {"drop_compute": {"threshold": "auto", "target_drop_rate": "100%"}},
            "drop_compute.target_drop_rate",
            "less than 1",
        ),
        ({"micro_batches": 1, "drop_compute": {"threshold": "auto"}}, "job config", ">= 2"),
        (
            {"strategy": "average", "drop_compute": {"threshold": "auto"}},
            "job config",
            "strategy gradient or sharded",
        ),
        ({"batch": 10, "micro_batches": 4}, "job config", "multiple of micro_batches"),
        ({"average_every": 4}, "job config", "strategy: average only"),
        ({"model": "resnet"}, "model", "'mlp', 'cnn' or 'char-lm'"),
        ({"optimizer": {"sgd": {"lr": 0.1}, "adam": {}}}, "optimizer", "exactly one of sgd, adam"),
        ({"optimizer": {"rmsprop": {}}}, "optimizer.rmsprop", "allowed: sgd, adam"),
        ({"straggler": {"lognormal": {"median": "1ms"}}}, "straggler.lognormal.sigma", "required"),
        ({"steps": 0}, "steps", "greater than or equal to 1"),
    ],
)
def test_bad_job_config_names_the_field(fields, field, message):
    base = {"micro_batches": 4, "batch": 32}
    with pytest.raises(TrainConfigError) as error:
        TrainConfig.parse(base, **fields)
    assert f"{field}: " in str(error.value)
    assert message in str(error.value)


def test_scenario_style_job_parses():
    config = TrainConfig.parse(
        {
            "model": "char-lm",
            "steps": 400,
            "batch": 32,
            "micro_batches": 4,
            "optimizer": {"adam": {"lr": 3e-4}},
            "drop_compute": {"threshold": "auto", "target_drop_rate": "10%"},
            "straggler": {"lognormal": {"median": "20ms", "sigma": 1.0}},
        }
    )
    assert config.optimizer.adam is not None and config.optimizer.adam.lr == 3e-4
    assert config.drop_compute is not None and config.drop_compute.target_drop_rate == 0.1
    assert TrainConfig.parse(drop_compute={"threshold": "20ms"}, micro_batches=2).drop_compute
