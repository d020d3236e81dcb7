"""The job's configuration: what to train, how the workers combine their work, what slows them.

Field names follow the scenario file (`job: {model: char-lm, steps: 400, batch: 32,
optimizer: {adam: {lr: 3e-4}}}`); bad input raises `TrainConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from netem.profile import Fraction, describe_errors
from netem.units import TIME_HELP, parse_time
from testbed.train.stragglers import StragglerSpec


class TrainConfigError(ValueError):
    """A job configuration that cannot be built; the message names the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SGD(_Spec):
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)


class Adam(_Spec):
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)


OPTIMIZERS = ("sgd", "adam")  # torch.optim's SGD and Adam (`strategies.build_optimizer`)


class OptimizerSpec(_Spec):
    """Exactly one of `sgd` or `adam`, with torch's own option names."""

    sgd: SGD | None = None
    adam: Adam | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> OptimizerSpec:
        given = [name for name in OPTIMIZERS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(OPTIMIZERS)}, got {given}")
        return self

    @property
    def name(self) -> str:
        """Which optimizer: sgd or adam."""
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
    warmup_steps: int = Field(default=10, ge=1)

    @model_validator(mode="after")
    def _auto_options(self) -> DropComputeSpec:
        if self.threshold == "auto":
            return self
        if self.model_fields_set & {"target_drop_rate", "warmup_steps"}:
            raise ValueError("target_drop_rate and warmup_steps apply to threshold: auto only")
        if self.threshold <= 0:
            raise ValueError("threshold: needs a positive duration or 'auto'")
        return self


class TrainConfig(_Spec):
    """One worker's job. `batch` samples per step are split into `micro_batches` equal parts
    (gradient accumulation, which DropCompute cuts short)."""

    model: Literal["mlp", "cnn", "char-lm"] = "mlp"
    steps: int = Field(default=100, ge=1)
    batch: int = Field(default=32, ge=1)
    micro_batches: int = Field(default=1, ge=1)
    optimizer: OptimizerSpec = OptimizerSpec(sgd=SGD(lr=0.1))
    strategy: Literal["gradient", "average", "sharded"] = "gradient"
    average_every: int = Field(default=1, ge=1)
    drop_compute: DropComputeSpec | None = None
    straggler: StragglerSpec | None = None
    seed: int = Field(default=0, ge=0)
    threads: int = Field(default=1, ge=1)
    eval_every: int = Field(default=0, ge=0)
    eval_samples: int = Field(default=512, ge=1)
    context: int = Field(default=64, ge=2)
    corpus_chars: int = Field(default=2_000_000, ge=10_000)
    width: int = Field(default=64, ge=4, multiple_of=4)  # char-lm: 4 heads share it
    layers: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.batch % self.micro_batches:
            raise ValueError(
                f"batch ({self.batch}) must be a multiple of micro_batches ({self.micro_batches})"
            )
        if "average_every" in self.model_fields_set and self.strategy != "average":
            raise ValueError("average_every applies to strategy: average only")
        if self.model_fields_set & {"width", "layers"} and self.model != "char-lm":
            raise ValueError("width and layers apply to model: char-lm only")
        if self.drop_compute is not None:
            if self.micro_batches < 2:
                raise ValueError("drop_compute needs micro_batches >= 2: it drops micro-batches")
            if self.strategy == "average":
                raise ValueError(
                    "drop_compute needs strategy gradient or sharded: local steps do not wait"
                )
        return self

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None = None, **fields: Any) -> TrainConfig:
        """Build from human values, raising `TrainConfigError` that names the bad field."""
        try:
            return cls.model_validate({**(spec or {}), **fields})
        except ValidationError as error:
            raise TrainConfigError(describe_errors(error, "job config", cls)) from None
