"""Jobs on GPUs, checked where there is none: a training job's `device` (a scenario for a GPU
host checks anywhere; the job refuses cuda where CUDA is missing, naming the field), a command
job's `gpus` (validated, each worker's CUDA_VISIBLE_DEVICES, Compose's device reservations,
refused by a Swarm stack) and NCCL put on the worker's shaped interface."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from testbed.cli import app
from testbed.cluster.command import GPUS_RESERVED, NCCL_SOCKETS_ONLY, environment
from testbed.cluster.worker import WorkerSpec
from testbed.compose import ComposeError
from testbed.compose.project import compose_project
from testbed.compose.swarm import swarm_stack
from testbed.scenario import ScenarioError, load_scenario
from testbed.train.config import TrainConfig
from testbed.train.job import Job

COMMAND = "name: g\nworkers: 3\njob: {command: [python, train.py]"


def command_scenario(extra: str = "") -> object:
    return load_scenario(f"{COMMAND}{extra}}}\n")


def test_a_scenario_for_cuda_checks_on_a_host_without_one(tmp_path: Path):
    path = tmp_path / "gpu.yaml"
    path.write_text("name: gpu\nworkers: 2\njob: {steps: 3, device: cuda}\n")
    assert load_scenario(path).job.device == "cuda"
    result = CliRunner().invoke(app, ["scenario", "check", str(path)])
    assert result.exit_code == 0, result.output


def test_a_cuda_job_without_cuda_names_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    collective = SimpleNamespace(name="ring", rank=0, world=1)
    with pytest.raises(ValueError, match=r"job\.device: cuda, but torch\.cuda\.is_available\(\) "
                                         r"is False on this host"):
        Job(TrainConfig(steps=1, device="cuda"), collective, 0, 1)


@pytest.mark.parametrize(("gpus", "message"), [
    ("0", r"job\.gpus: expected all, a number of GPUs \(1 or more\) or a list"),
    ("true", r"job\.gpus: expected all, .* got True"),
    ("[0, -1, 1]", r"job\.gpus: worker 1: expected a GPU's index \(0 or more\), got -1"),
    ("[0, [1, 1], 2]", r"job\.gpus: worker 1: a GPU listed twice in \[1, 1\]"),
    ("[0, 1]", r"job\.gpus: expected one entry per worker \(3\), got 2"),
])
def test_gpus_are_validated_with_the_forms_allowed(gpus, message):
    with pytest.raises(ScenarioError, match=message):
        command_scenario(f", gpus: {gpus}")


@pytest.mark.parametrize(("gpus", "expected"), [
    ("all", [None, None, None]),
    ("2", [[0], [1], [0]]),  # shared round the GPUs
    ("[1, [0, 2], 1]", [[1], [0, 2], [1]]),
])
def test_each_worker_gets_its_gpus(gpus, expected):
    job = command_scenario(f", gpus: {gpus}").command
    assert [job.worker_gpus(rank) for rank in range(3)] == expected
    assert job.uses_nccl


def spec(tmp_path: Path, rank: int) -> WorkerSpec:
    return WorkerSpec(scenario=str(tmp_path / "s.yaml"), rank=rank, world=3,
                      hosts=["127.0.0.1"] * 3, run_dir=str(tmp_path))


def test_a_worker_sees_its_gpus_and_nccl_speaks_over_its_interface(tmp_path: Path):
    job = command_scenario(", gpus: [1, [0, 2], 1], env: {NCCL_DEBUG: INFO}").command
    env = environment(spec(tmp_path, 1), job, base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["NCCL_SOCKET_IFNAME"] == f"={env['GLOO_SOCKET_IFNAME']}"
    assert {name: env[name] for name in NCCL_SOCKETS_ONLY} == NCCL_SOCKETS_ONLY
    assert env["NCCL_DEBUG"] == "INFO"
    # In a container whose GPUs were reserved for it, those are all it sees.
    reserved = environment(spec(tmp_path, 1), job, base={GPUS_RESERVED: "1"})
    assert "CUDA_VISIBLE_DEVICES" not in reserved and "NCCL_SOCKET_IFNAME" in reserved


def test_nccl_is_left_alone_without_gpus_unless_asked(tmp_path: Path):
    untouched = environment(spec(tmp_path, 0), command_scenario().command, base={})
    assert not {"CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", *NCCL_SOCKETS_ONLY} & set(untouched)
    asked = environment(spec(tmp_path, 0), command_scenario(", nccl: true").command, base={})
    assert "NCCL_SOCKET_IFNAME" in asked and "CUDA_VISIBLE_DEVICES" not in asked
    declined = command_scenario(", gpus: 1, nccl: false").command
    env = environment(spec(tmp_path, 0), declined, base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "NCCL_SOCKET_IFNAME" not in env


def test_compose_reserves_each_workers_gpus():
    services = compose_project(command_scenario(", gpus: [1, [0, 2], 1]"))["services"]
    devices = [services[f"worker-{rank}"]["deploy"]["resources"]["reservations"]["devices"]
               for rank in range(3)]
    assert devices[1] == [{"driver": "nvidia", "device_ids": ["0", "2"],
                           "capabilities": ["gpu"]}]
    assert [d[0]["device_ids"] for d in devices] == [["1"], ["0", "2"], ["1"]]
    assert services["worker-0"]["environment"] == {GPUS_RESERVED: "1"}
    every = compose_project(command_scenario(", gpus: all"))["services"]["worker-2"]
    assert every["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    plain = compose_project(command_scenario())["services"]["worker-0"]
    assert "deploy" not in plain and "environment" not in plain


def test_a_swarm_stack_refuses_gpus(tmp_path: Path):
    with pytest.raises(ComposeError, match=r"job\.gpus: a Swarm stack cannot reserve GPUs"):
        swarm_stack(command_scenario(", gpus: 1"), tmp_path)
