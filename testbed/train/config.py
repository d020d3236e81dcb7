"""The job's configuration: what to train, how the workers combine their work, what slows them.

Field names follow the scenario file (`job: {model: char-lm, steps: 400, batch: 32,
optimizer: {adam: {lr: 3e-4}}}`); bad input raises `TrainConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from netem.profile import A_NUMBER, Fraction, Integer, Number, describe_errors
from netem.units import TIME_HELP, parse_time
from testbed.train.stragglers import StragglerSpec


class TrainConfigError(ValueError):
    """A job configuration that cannot be built; the message names the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SGD(_Spec):
    lr: Number = Field(gt=0)
    momentum: Number = Field(default=0.0, ge=0, lt=1)
    weight_decay: Number = Field(default=0.0, ge=0)


class Adam(_Spec):
    lr: Number = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: Number = Field(default=0.0, ge=0)


class AdamW(_Spec):
    lr: Number = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: Number = Field(default=0.01, ge=0)


# torch.optim's SGD, Adam and AdamW (`strategies.build_optimizer`)
OPTIMIZERS = ("sgd", "adam", "adamw")


class OptimizerSpec(_Spec):
    """Exactly one of `sgd`, `adam` or `adamw`, with torch's own option names."""

    sgd: SGD | None = None
    adam: Adam | None = None
    adamw: AdamW | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> OptimizerSpec:
        given = [name for name in OPTIMIZERS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(OPTIMIZERS)}, got {given}")
        return self

    @property
    def name(self) -> str:
        """Which optimizer: sgd, adam or adamw."""
        return next(name for name in OPTIMIZERS if getattr(self, name) is not None)

    def options(self) -> dict[str, Any]:
        """Its options, by torch's own names."""
        return getattr(self, self.name).model_dump()


def parse_threshold(value: Any) -> Any:
    """DropCompute's threshold: 'auto', or a duration in seconds."""
    if value == "auto":
        return value
    try:
        return parse_time(value)
    except ValueError:
        raise ValueError(f"expected 'auto' or {TIME_HELP}, got {value!r}") from None


class DropComputeSpec(_Spec):
    """Stop computing micro-batches after `threshold` seconds of compute in a step, or pick the
    threshold (`auto`) after `warmup_steps` full steps so `target_drop_rate` of the micro-batches
    are dropped (rule in `testbed.train.dropcompute`)."""

    threshold: Annotated[float | Literal["auto"], BeforeValidator(parse_threshold)]
    target_drop_rate: Fraction = Field(default=0.1, lt=1)
    warmup_steps: Integer = Field(default=10, ge=1)

    @model_validator(mode="after")
    def _auto_options(self) -> DropComputeSpec:
        if self.threshold == "auto":
            return self
        if self.model_fields_set & {"target_drop_rate", "warmup_steps"}:
            raise ValueError("target_drop_rate and warmup_steps apply to threshold: auto only")
        if self.threshold <= 0:
            raise ValueError("threshold: needs a positive duration or 'auto'")
        return self


class OuterSpec(_Spec):
    """DiLoCo's outer optimizer, stepping the synced parameters with the workers' mean
    pseudo-gradient: SGD with Nesterov momentum as published (lr 0.7, momentum 0.9)."""

    name: Literal["sgd"] = "sgd"
    lr: Number = Field(default=0.7, gt=0)
    momentum: Number = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = True

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterSpec:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov: needs momentum > 0 (or nesterov: false)")
        return self

    def options(self) -> dict[str, Any]:
        """Its options, by torch.optim.SGD's own names."""
        return self.model_dump(exclude={"name"})


class StreamingSpec(_Spec):
    """Streaming DiLoCo: the parameters cut into `fragments`, each synchronised once every
    inner_steps at its own offset; with `overlap`, its outer all-reduce runs beside the inner
    steps and its result is mixed in when it is back (`mixing`: the local parameters' weight)."""

    fragments: Integer = Field(ge=1)
    overlap: bool = False
    mixing: Annotated[float, Field(ge=0, lt=1), A_NUMBER] | None = Field(default=None)

    @model_validator(mode="after")
    def _mixing_with_overlap(self) -> StreamingSpec:
        if self.mixing is not None and not self.overlap:
            raise ValueError("mixing applies to overlap: true only (without overlap a fragment "
                             "takes the synced parameters)")
        return self

    @property
    def local_weight(self) -> float:
        """The local parameters' weight when an outer result is mixed in: `mixing`, by default
        0.5 with overlap (the paper's) and 0 without (the synced parameters as they are)."""
        if self.mixing is not None:
            return self.mixing
        return 0.5 if self.overlap else 0.0


DILOCO_FIELDS = ("inner_steps", "outer", "streaming")  # apply to strategy diloco only


class TrainConfig(_Spec):
    """One worker's job. `batch` samples per step are split into `micro_batches` equal parts
    (gradient accumulation, which DropCompute cuts short)."""

    model: Literal["mlp", "cnn", "char-lm"] = "mlp"
    steps: Integer = Field(default=100, ge=1)
    batch: Integer = Field(default=32, ge=1)
    micro_batches: Integer = Field(default=1, ge=1)
    optimizer: OptimizerSpec = OptimizerSpec(sgd=SGD(lr=0.1))
    strategy: Literal["gradient", "average", "sharded", "diloco"] = "gradient"
    average_every: Integer = Field(default=1, ge=1)
    inner_steps: Integer = Field(default=50, ge=1)
    outer: OuterSpec = OuterSpec()
    streaming: StreamingSpec | None = None
    drop_compute: DropComputeSpec | None = None
    straggler: StragglerSpec | None = None
    seed: Integer = Field(default=0, ge=0)
    threads: Integer = Field(default=1, ge=1)
    # Where the model trains: cuda is checked where the job starts (`job.job_device`, which
    # names this field), so a scenario for a GPU host checks anywhere.
    device: Literal["cpu", "cuda"] = "cpu"
    eval_every: Integer = Field(default=0, ge=0)
    eval_samples: Integer = Field(default=512, ge=1)
    context: Integer = Field(default=64, ge=2)
    corpus_chars: Integer = Field(default=2_000_000, ge=10_000)
    width: Integer = Field(default=64, ge=4, multiple_of=4)  # char-lm: 4 heads share it
    layers: Integer = Field(default=2, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _diloco_inner_optimizer(cls, data: Any) -> Any:
        """DiLoCo's inner optimizer is AdamW unless the job names one."""
        if isinstance(data, Mapping) and data.get("strategy") == "diloco" \
                and "optimizer" not in data:
            return {**data, "optimizer": {"adamw": {}}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.batch % self.micro_batches:
            raise ValueError(
                f"batch ({self.batch}) must be a multiple of micro_batches ({self.micro_batches})"
            )
        if "average_every" in self.model_fields_set and self.strategy != "average":
            raise ValueError("average_every applies to strategy: average only")
        if self.strategy == "diloco":
            self._diloco_problems()
        elif given := [name for name in DILOCO_FIELDS if name in self.model_fields_set]:
            raise ValueError(f"{', '.join(given)}: applies to strategy: diloco only")
        if self.model_fields_set & {"width", "layers"} and self.model != "char-lm":
            raise ValueError("width and layers apply to model: char-lm only")
        if self.drop_compute is not None:
            if self.micro_batches < 2:
                raise ValueError("drop_compute needs micro_batches >= 2: it drops micro-batches")
            if self.strategy in ("average", "diloco"):
                raise ValueError(
                    "drop_compute needs strategy gradient or sharded: local steps do not wait"
                )
        return self

    def _diloco_problems(self) -> None:
        """inner_steps against steps and the streaming fragments (their count against the
        model's parameter tensors is checked where the model is built)."""
        if self.inner_steps > self.steps:
            raise ValueError(f"inner_steps: {self.inner_steps} is more than steps "
                             f"({self.steps}): no outer step would be taken")
        if self.streaming is not None and self.streaming.fragments > self.inner_steps:
            raise ValueError(f"streaming.fragments: {self.streaming.fragments} is more than "
                             f"inner_steps ({self.inner_steps}): each fragment needs a step of "
                             "its own in every inner_steps")

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None = None, **fields: Any) -> TrainConfig:
        """Build from human values, raising `TrainConfigError` that names the bad field."""
        try:
            return cls.model_validate({**(spec or {}), **fields})
        except ValidationError as error:
            raise TrainConfigError(describe_errors(error, "job config", cls)) from None
