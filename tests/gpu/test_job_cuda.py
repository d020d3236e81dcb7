"""The training job with `device: cuda` (tier gpu): the model, the data and the gradients on
the GPU, each step's all-reduce through the collective, the held-out evaluation on the GPU
too, and the state a rejoining worker is handed on the host."""

from __future__ import annotations

import pytest

from testbed.collectives.ring import Ring
from testbed.train.config import TrainConfig
from testbed.train.job import Job

pytestmark = pytest.mark.gpu


def test_a_cuda_job_trains_and_evaluates_on_the_gpu():
    ring = Ring(0, 1, addresses=[("127.0.0.1", 0)])
    try:
        job = Job(TrainConfig(steps=10, device="cuda"), ring, 0, 1)
        assert all(parameter.is_cuda for parameter in job.parameters)
        before = job.evaluate()["loss"]
        records = [job.step(step) for step in range(10)]
        assert all(record.stats is not None for record in records)
        assert job.evaluate()["loss"] < before
        state = job.state()
        assert state.device.type == "cpu"
        job.restore(state * 0)
        assert all(parameter.is_cuda and not parameter.any() for parameter in job.parameters)
    finally:
        ring.close()
