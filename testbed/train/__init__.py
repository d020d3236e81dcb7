"""Data-parallel training jobs over any collective: real models on data that ships with Python
and scikit-learn, injected stragglers, DropCompute, and per-step records for metrics."""

from testbed.train.config import (
    SGD,
    Adam,
    DropComputeSpec,
    OptimizerSpec,
    TrainConfig,
    TrainConfigError,
)
from testbed.train.job import (
    Clock,
    Job,
    RunSummary,
    StepRecord,
    SystemClock,
    TrainResult,
    summarize,
    train,
)
from testbed.train.stragglers import StragglerDelay, StragglerError, StragglerSpec

__all__ = [
    "SGD",
    "Adam",
    "Clock",
    "DropComputeSpec",
    "Job",
    "OptimizerSpec",
    "RunSummary",
    "StepRecord",
    "StragglerDelay",
    "StragglerError",
    "StragglerSpec",
    "SystemClock",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "summarize",
    "train",
]
