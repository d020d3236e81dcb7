"""Injected compute delay: what a slow, noisy or preempted machine adds to a worker's steps.

A worker's spec maps kinds to parameters, e.g. `{lognormal: {median: 20ms, sigma: 1.0}}`;
several kinds add up (a lognormal base plus bursts). Each kind draws from its own numpy
Generator seeded from (seed, rank, kind), so a run replays the same delays, workers are
independent, and adding bursts to a spec leaves its lognormal draws unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from netem.profile import Fraction, Integer, Number, Seconds, describe_errors

KINDS = ("fixed", "exponential", "lognormal", "burst")


class StragglerError(ValueError):
    """A straggler spec that cannot be built; the message names the field and what is allowed."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Exponential(_Spec):
    """Memoryless noise: most steps a little slow, now and then much slower."""

    mean: Seconds = Field(gt=0)


class LogNormal(_Spec):
    """Heavy-tailed noise as measured on shared machines: `median` and the log-space `sigma`."""

    median: Seconds = Field(gt=0)
    sigma: Number = Field(ge=0)


class Burst(_Spec):
    """With `probability` per step (outside a burst) a delay of `delay` for `steps` steps."""

    probability: Fraction
    delay: Seconds
    steps: Integer = Field(default=1, ge=1)

    @property
    def busy_fraction(self) -> float:
        """Long-run fraction of steps inside a burst: idle runs average (1-p)/p steps."""
        p, k = self.probability, self.steps
        return p * k / (p * k + 1 - p)


class StragglerSpec(_Spec):
    """One worker's injected delay per step; the kinds given add up."""

    fixed: Seconds | None = None
    exponential: Exponential | None = None
    lognormal: LogNormal | None = None
    burst: Burst | None = None

    @model_validator(mode="after")
    def _some_kind(self) -> StragglerSpec:
        if all(getattr(self, kind) is None for kind in KINDS):
            raise ValueError(f"give at least one of {', '.join(KINDS)}")
        return self

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> StragglerSpec:
        """Build from human values, raising `StragglerError` that names the bad field."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise StragglerError(describe_errors(error, "straggler spec", cls)) from None

    @property
    def mean_seconds(self) -> float:
        """Expected delay per step (long-run average for bursts)."""
        total = self.fixed or 0.0
        if self.exponential:
            total += self.exponential.mean
        if self.lognormal:
            total += self.lognormal.median * math.exp(self.lognormal.sigma**2 / 2)
        if self.burst:
            total += self.burst.busy_fraction * self.burst.delay
        return total


class StragglerDelay:
    """The delays one worker injects, step after step, reproducibly from (seed, rank)."""

    def __init__(self, spec: StragglerSpec, seed: int, rank: int) -> None:
        self.spec = spec
        streams = np.random.SeedSequence([seed, rank]).spawn(len(KINDS))
        self._rng = dict(zip(KINDS, map(np.random.default_rng, streams), strict=True))
        self._burst_left = 0

    def next(self) -> float:
        """Seconds to add to the next step's compute."""
        spec = self.spec
        total = spec.fixed or 0.0
        if spec.exponential:
            total += float(self._rng["exponential"].exponential(spec.exponential.mean))
        if spec.lognormal:
            log_median = math.log(spec.lognormal.median)
            total += float(np.exp(self._rng["lognormal"].normal(log_median, spec.lognormal.sigma)))
        if spec.burst:
            if self._burst_left == 0 and self._rng["burst"].random() < spec.burst.probability:
                self._burst_left = spec.burst.steps
            if self._burst_left:
                self._burst_left -= 1
                total += spec.burst.delay
        return total
