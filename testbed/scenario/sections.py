"""The smaller sections of a scenario: workers, security, metrics, capture, and the job (a
training job is `testbed.train.TrainConfig` itself; a command of the user's own is
`CommandJob`)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    model_validator,
)

from netem.profile import AN_INTEGER, Integer, Number, Seconds
from netem.units import format_size, parse_size
from testbed.scenario.fields import Congestion, Section, WorkerList, as_list
from testbed.scenario.topology import LinkText
from testbed.train.config import TrainConfig
from testbed.train.stragglers import StragglerSpec

# --- workers ------------------------------------------------------------------------------------


class WorkerOverride(Section):
    """Settings of some workers that differ from the others'."""

    worker: WorkerList
    straggler: StragglerSpec | None = None
    slowdown: Number = Field(default=1.0, ge=1.0)
    congestion: Congestion | None = None

    @model_validator(mode="after")
    def _overrides_something(self) -> WorkerOverride:
        if self.model_fields_set <= {"worker"}:
            raise ValueError("give at least one of straggler, slowdown, congestion")
        return self


class Workers(Section):
    """`count` workers (ranks 0..count-1); `overrides` set single workers apart."""

    count: Integer = Field(ge=1, le=256)
    overrides: list[WorkerOverride] = Field(default=[])


def worker_count(value: Any) -> Any:
    """`workers: 4` is `workers: {count: 4}`."""
    if isinstance(value, bool | str | float):
        raise ValueError(
            f"expected a number of workers or a mapping {{count, overrides}}, got {value!r}"
        )
    return {"count": value} if isinstance(value, int) else value


# --- security -----------------------------------------------------------------------------------


def _switch(value: Any) -> Any:
    """true, false or auto; not 1 or 'yes' (YAML's yes/no/on/off are booleans already)."""
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ValueError(f"expected true, false or {AUTO}, got {value!r}")


AUTO = "auto"
Switch = Annotated[Literal["auto", True, False], BeforeValidator(_switch)]
Placement = Literal["namespaces", "compose"]


class Security(Section):
    """Who may speak on a run's sockets (docs/transport.md, "Who may send"). A datagram is
    always taken only from the address registered for the rank it names. With `authenticate`,
    each run also has a secret: every datagram carries a MAC of it and every TCP hello proves
    it, so not even a stranger that forges a peer's source address is heard. `auto`: on under
    Compose (a network others may share), off in namespaces (only this host's processes reach
    them, and the MAC costs CPU per datagram: benchmarks/results/datagram-cost.md)."""

    authenticate: Switch = Field(default=AUTO, description="true, false or auto (on under "
                                 "Compose, off in namespaces): a secret per run, a MAC on every "
                                 "datagram and proof of it in every TCP hello.")


# --- metrics ------------------------------------------------------------------------------------


class Metrics(Section):
    """What the workers export besides their per-step events: `/metrics` on `port` in each
    worker's namespace (0: any free port), parameter drift every `drift_every` steps (0: never)
    from a `drift_k`-dimensional random projection, and a probe of every link before training
    (`probe_links`: configured against measured, as `testbed probe` does). `linger`: seconds
    a finished worker keeps its endpoint up (until the whole run is done). `dump_parameters`:
    each drift measurement also writes the vector it sketched into the run directory, so the
    estimate can be checked against the exact distance."""

    port: Integer = Field(default=9100, ge=0, le=65535)
    drift_every: Integer = Field(default=10, ge=0)
    drift_k: Annotated[int, Field(ge=1), AN_INTEGER] | None = Field(default=None, description=(
        "Numbers in each drift sketch (null: the estimator's default, 64)."))
    dump_parameters: bool = Field(default=False, description=(
        "At every drift measurement each worker also writes its flat parameter vector to the "
        "run directory (parameters/rank<R>-step<S>.npy): what the sketch estimated, in full."))
    probe_links: bool = False
    linger: Seconds = Field(default=0.0, ge=0, description=(
        "Seconds a worker keeps serving /metrics after its last step, so a scraper sees the "
        "final values; the run ends them as soon as every worker is done."))


# --- capture ------------------------------------------------------------------------------------


def byte_size(value: Any, info: ValidationInfo) -> int:
    """A size, with its unit in human input (a bare `max_bytes: 20` would be 20 bytes)."""
    return parse_size(value, unit_required=bool(info.context and info.context.get("human")))


ByteSize = Annotated[int, BeforeValidator(byte_size)]


class Capture(Section):
    """Links whose frames are recorded during a run (docs/capture.md): for each directed link
    src->dst, what src put on the wire towards dst and what reached dst from src, as pcap files
    of the run directory (`capture/SRC-DST.sent.pcap`, `.received.pcap`), and what the link did
    to each flow (`capture/flows.json`)."""

    links: list[LinkText] = Field(default=[], description="The links to capture: '0->1', "
                                  "'0<->2', 'east->west', 'all', or {from, to} / {between}.")
    max_bytes: ByteSize = Field(default=20_000_000, ge=1000, le=10**12, description="Each "
                                "file's size limit (20MB, 512kB, 1MiB): writing stops there "
                                "and the file is marked truncated.")
    snap: Integer = Field(default=128, ge=64, le=65535, description="Bytes kept of each frame "
                          "(headers and the first payload bytes).")

    def pairs(self, groups: Mapping[str, list[int]], count: int) -> list[tuple[int, int]]:
        """Every directed link (src, dst) selected, each once, in the order given."""
        seen: dict[tuple[int, int], None] = {}
        for link in self.links:
            seen.update(dict.fromkeys(link.pairs(groups, count)))
        return list(seen)

    def describe(self) -> str:
        return (f"{', '.join(link.describe() for link in self.links)} "
                f"({format_size(self.max_bytes)} per file, snap {self.snap})")


# --- the job: a training job, or a command of the user's own ----------------------------------


MASTER_PORT = 29400  # torch.distributed's rendezvous on worker 0 (apart from the testbed's ports)


def _argv(value: Any) -> Any:
    """The program and its arguments, a list; a string (a shell's command line) is refused with
    the list it stands for."""
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError:
            words = value.split()
        raise ValueError(f"expected a list of the program and its arguments (no shell splits a "
                         f"string here), e.g. command: {json.dumps(words)}")
    return value


ALL_GPUS = "all"
_GPUS_WORDS = "all, a number of GPUs (1 or more) or a list with each worker's GPU index(es)"


def _gpu_index(value: Any, rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"worker {rank}: expected a GPU's index (0 or more), got {value!r}")
    return value


def _gpus(value: Any) -> Any:
    """`all`, a count, or per worker a GPU's index or a list of them (made a list), each
    wrong value named with the forms allowed."""
    if value == ALL_GPUS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected {_GPUS_WORDS}, got {value!r}")
    workers = []
    for rank, given in enumerate(value):
        indexes = [_gpu_index(index, rank) for index in as_list(given)]
        if not indexes:
            raise ValueError(f"worker {rank}: expected a GPU's index or a list of them, got []")
        if len(set(indexes)) < len(indexes):
            raise ValueError(f"worker {rank}: a GPU listed twice in {indexes}")
        workers.append(indexes)
    return workers


GpuIndex = Annotated[int, Field(ge=0)]
Gpus = Annotated[Literal["all"] | Annotated[int, Field(ge=1)] | list[GpuIndex | list[GpuIndex]],
                 BeforeValidator(_gpus)]


class CommandJob(Section):
    """A program of the user's own as the job (docs/your-code.md): every worker runs it in its
    namespace (or container) with the torch.distributed environment set (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, ...), so a script written for torchrun runs unmodified."""

    command: Annotated[list[str], BeforeValidator(_argv)] = Field(
        min_length=1, description="The program and its arguments, run in `cwd`; `python` is "
        "the interpreter that runs the testbed.")
    env: dict[str, str] = Field(default={}, description="More environment variables for it.")
    cwd: str | None = Field(default=None, description="Where it runs: a directory inside the "
                            "scenario file's, relative to it (default: the scenario file's "
                            "directory).")
    master_port: Integer = Field(default=MASTER_PORT, ge=1, le=65535, description="MASTER_PORT: "
                                 "where torch.distributed's rendezvous listens on worker 0.")
    metrics_port: Annotated[int, Field(ge=1, le=65535), AN_INTEGER] | None = Field(
        default=None, description="A port the program serves Prometheus metrics on in each "
        "worker: scraped with the workers' own (TESTBED_METRICS_PORT).")
    gpus: Gpus | None = Field(default=None, description="The host's GPUs each worker sees "
                              "(CUDA_VISIBLE_DEVICES, by nvidia-smi's indexes; under Compose, "
                              "reserved for its container): all, a number N (worker r gets GPU r "
                              "mod N, so workers share GPUs where there are more of them), or a "
                              "list with each worker's GPU index or indexes. Null: the host's "
                              "environment decides.")
    nccl: bool | None = Field(default=None, description="NCCL over the worker's shaped "
                              "interface, with sockets only (NCCL_SOCKET_IFNAME; peer-to-peer, "
                              "shared memory, InfiniBand and NVLink SHARP off), so its traffic "
                              "crosses the scenario's links. Null: whenever gpus is given.")

    def worker_gpus(self, rank: int) -> list[int] | None:
        """The indexes of worker `rank`'s GPUs; None: no choice made (every GPU it finds)."""
        if self.gpus is None or self.gpus == ALL_GPUS:
            return None
        if isinstance(self.gpus, int):
            return [rank % self.gpus]
        return as_list(self.gpus[rank])

    @property
    def uses_nccl(self) -> bool:
        """Whether NCCL is put on the shaped links (`nccl`, by default with `gpus`)."""
        return self.gpus is not None if self.nccl is None else self.nccl


def job_kind(value: Any) -> str:
    """Which job a scenario's `job` is: a command of the user's own, or a training job."""
    is_command = isinstance(value, CommandJob) or (isinstance(value, dict) and "command" in value)
    return COMMAND_JOB if is_command else TRAINING_JOB


TRAINING_JOB, COMMAND_JOB = "training job", "command job"  # tags of `job`'s union
TOP_LEVEL = ("seed",)  # the training job's fields a scenario sets at its top level, not in job
JobSpec = Annotated[
    Annotated[TrainConfig, Tag(TRAINING_JOB)] | Annotated[CommandJob, Tag(COMMAND_JOB)],
    Discriminator(job_kind),
]
