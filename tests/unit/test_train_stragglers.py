"""Straggler delays: validated specs that name the bad field, reproducible draws, and the
medians and means the spec promises (statistical checks, bounded samples, fixed seeds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.train.stragglers import StragglerDelay, StragglerError, StragglerSpec

DRAWS = 20_000


def draws(spec: dict, seed: int = 0, rank: int = 0, count: int = DRAWS) -> np.ndarray:
    delay = StragglerDelay(StragglerSpec.parse(spec), seed, rank)
    return np.array([delay.next() for _ in range(count)])


@pytest.mark.parametrize(
    ("spec", "field", "allowed"),
    [
        ({}, "straggler spec", "fixed, exponential, lognormal, burst"),
        ({"gamma": {"shape": 2}}, "gamma", "allowed: fixed, exponential, lognormal, burst"),
        ({"fixed": "10 parsecs"}, "fixed", "duration"),
        ({"lognormal": {"median": "20ms"}}, "lognormal.sigma", "Field required"),
        ({"lognormal": {"median": "0ms", "sigma": 1}}, "lognormal.median", "greater than 0"),
        ({"lognormal": {"median": "2ms", "sigma": -1}}, "lognormal.sigma", "greater than or equal"),
        ({"lognormal": {"median": "2ms", "sigma": 1, "mu": 0}}, "lognormal.mu", "median, sigma"),
        ({"exponential": {"mean": "-5ms"}}, "exponential.mean", "not negative"),
        ({"burst": {"probability": "150%", "delay": "1s"}}, "burst.probability", "percentage"),
        ({"burst": {"probability": "1%", "delay": "1s", "steps": 0}}, "burst.steps", "greater"),
    ],
)
def test_bad_spec_names_the_field_and_what_is_allowed(spec, field, allowed):
    with pytest.raises(StragglerError) as error:
        StragglerSpec.parse(spec)
    assert f"{field}: " in str(error.value)
    assert allowed in str(error.value)


def test_draws_replay_under_a_seed_and_differ_between_workers():
    spec = {"lognormal": {"median": "20ms", "sigma": 1}, "burst": {"probability": "5%", "delay": 1}}
    assert np.array_equal(draws(spec, seed=7, rank=2, count=500), draws(spec, 7, 2, 500))
    assert not np.array_equal(draws(spec, 7, 2, 500), draws(spec, 7, 3, 500))
    assert not np.array_equal(draws(spec, 7, 2, 500), draws(spec, 8, 2, 500))


def test_kinds_add_up_and_keep_their_own_draws():
    lognormal = {"lognormal": {"median": "20ms", "sigma": 1}}
    combined = draws({**lognormal, "fixed": "5ms", "burst": {"probability": 0, "delay": 1}}, 3)
    np.testing.assert_allclose(combined, draws(lognormal, 3) + 0.005)


def test_fixed_is_exact():
    assert set(draws({"fixed": "15ms"}, count=100)) == {0.015}


def test_lognormal_has_the_median_and_mean_asked_for():
    values = draws({"lognormal": {"median": "20ms", "sigma": 0.5}})
    # Standard errors here are under 0.5%; the bounds leave about six of them.
    assert np.median(values) == pytest.approx(0.020, rel=0.03)
    assert values.mean() == pytest.approx(0.020 * math.exp(0.5**2 / 2), rel=0.03)
    assert np.std(np.log(values)) == pytest.approx(0.5, rel=0.03)


def test_exponential_has_the_mean_and_median_asked_for():
    values = draws({"exponential": {"mean": "10ms"}})
    assert values.mean() == pytest.approx(0.010, rel=0.03)
    assert np.median(values) == pytest.approx(0.010 * math.log(2), rel=0.04)


def test_bursts_last_their_steps_and_cover_the_expected_fraction():
    spec = StragglerSpec.parse({"burst": {"probability": "5%", "delay": "100ms", "steps": 4}})
    values = draws(spec.model_dump())
    busy = values > 0
    assert set(values) == {0.0, 0.1}
    assert values.mean() == pytest.approx(spec.mean_seconds, rel=0.1)
    # Every run of delayed steps is a whole number of bursts of 4 (bursts may follow at once).
    edges = np.flatnonzero(np.diff(np.concatenate([[0], busy.astype(int), [0]])))
    runs = edges[1::2] - edges[::2]
    assert np.all(runs[:-1] % 4 == 0)


def test_mean_seconds_adds_up_the_kinds():
    spec = StragglerSpec.parse(
        {
            "fixed": "1ms",
            "exponential": {"mean": "2ms"},
            "lognormal": {"median": "4ms", "sigma": 1},
            "burst": {"probability": 1, "delay": "8ms", "steps": 3},
        }
    )
    assert spec.mean_seconds == pytest.approx(0.001 + 0.002 + 0.004 * math.exp(0.5) + 0.008)
