"""`LinkProfile`: one validated, immutable description of what a link does to packets.

It covers everything netem does (delay, jitter and its distribution, loss, bursty
Gilbert-Elliott loss, duplication, corruption, reordering, rate, queue limit). Values are kept
on the kernel's own grid (nanoseconds, 32-bit probabilities, whole bytes per second) so that a
profile applied to the kernel and read back compares equal to the original.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from netem.units import (
    format_fraction,
    format_rate,
    format_time,
    parse_fraction,
    parse_rate,
    parse_time,
)

DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
DEFAULT_LIMIT = 1000
MAX_JITTER = (2**31 - 1) / 1e9  # netem's delay table takes a signed 32-bit sigma in ns


def _on_grid(value: float) -> float:
    """Probabilities and seconds are kept to 9 decimals: the kernel's u32/ns grid is finer."""
    return round(value, 9)


# Validation context of human input (`LinkProfile.parse`, scenario files): a link's times and
# rate need their unit there; code that builds profiles in base units validates without it.
HUMAN = {"human": True}


def _human(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("human"))


def _link_time(value: Any, info: ValidationInfo) -> float:
    return _on_grid(parse_time(value, unit_required=_human(info)))


def _link_rate(value: Any, info: ValidationInfo) -> int:
    return max(8, parse_rate(value, unit_required=_human(info)) // 8 * 8)


Seconds = Annotated[float, BeforeValidator(lambda v: _on_grid(parse_time(v)))]
LinkTime = Annotated[float, BeforeValidator(_link_time)]  # a unit required in human input
Fraction = Annotated[float, BeforeValidator(lambda v: _on_grid(parse_fraction(v)))]
BitsPerSecond = Annotated[int, BeforeValidator(_link_rate)]  # a unit required in human input


class ProfileError(ValueError):
    """A link profile that cannot be built; the message names the field and what is allowed."""


class GilbertElliott(BaseModel):
    """Bursty loss: a two-state Markov chain (netem's `loss gemodel p r 1-h 1-k`).

    The chain moves good -> bad with probability `p` and bad -> good with `r` per packet; a packet
    is lost with probability `loss_bad` (1-h) in the bad state, `loss_good` (1-k) in the good one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    p: Fraction
    r: Fraction = 1.0
    loss_bad: Fraction = Field(default=1.0, alias="1-h")
    loss_good: Fraction = Field(default=0.0, alias="1-k")

    @property
    def mean_loss(self) -> float:
        """Stationary loss rate of the chain."""
        if self.p + self.r == 0:
            return self.loss_good
        bad = self.p / (self.p + self.r)
        return bad * self.loss_bad + (1 - bad) * self.loss_good

    @property
    def mean_burst(self) -> float:
        """Mean number of consecutive packets spent in the bad state (1/r)."""
        return float("inf") if self.r == 0 else 1.0 / self.r


class LinkProfile(BaseModel):
    """What one directed link does to packets. All fields default to a perfect link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delay: LinkTime = 0.0
    jitter: LinkTime = 0.0
    delay_correlation: Fraction = 0.0
    distribution: Literal["uniform", "normal", "pareto", "paretonormal"] = "uniform"
    loss: Fraction = 0.0
    loss_correlation: Fraction = 0.0
    gilbert_elliott: GilbertElliott | None = None
    duplicate: Fraction = 0.0
    duplicate_correlation: Fraction = 0.0
    corrupt: Fraction = 0.0
    corrupt_correlation: Fraction = 0.0
    reorder: Fraction = 0.0
    reorder_correlation: Fraction = 0.0
    gap: int = Field(default=0, ge=0, le=2**32 - 1)  # 1 behaves as 0 in netem; kept as 0
    rate: BitsPerSecond | None = None
    limit: int = Field(default=DEFAULT_LIMIT, ge=1, le=2**32 - 1)

    @field_validator("distribution", mode="before")
    @classmethod
    def _known_distribution(cls, value: Any) -> Any:
        if value not in DISTRIBUTIONS:
            raise ValueError(f"expected one of {', '.join(DISTRIBUTIONS)}, got {value!r}")
        return value

    @field_validator("gap")
    @classmethod
    def _gap_on_kernel_grid(cls, value: int) -> int:
        return 0 if value == 1 else value

    @field_validator("jitter")
    @classmethod
    def _jitter_within_netem(cls, value: float) -> float:
        if value > MAX_JITTER:
            raise ValueError(f"netem takes a jitter of at most {MAX_JITTER}s, got {value}s")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LinkProfile:
        if self.jitter > 0 and self.delay == 0:
            raise ValueError("jitter needs a delay: netem varies the delay around its mean")
        if self.distribution != "uniform" and self.jitter == 0:
            raise ValueError(
                f"distribution {self.distribution!r} needs a jitter: it shapes the delay variation"
            )
        if self.loss > 0 and self.gilbert_elliott is not None:
            raise ValueError("give either loss (random) or gilbert_elliott (bursty), not both")
        if (self.reorder > 0 or self.gap > 0) and self.delay == 0:
            raise ValueError("reorder needs a delay: netem reorders by sending some packets early")
        if self.gap > 0 and self.reorder == 0:
            raise ValueError("gap needs reorder > 0")
        return self

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None = None, **fields: Any) -> LinkProfile:
        """Build a profile from human values ('10ms', '5%', '100mbit': times and rates with
        their unit), raising `ProfileError` that names the bad field."""
        return cls._validated({**(spec or {}), **fields}, HUMAN)

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> LinkProfile:
        """Build a profile from values in base units (seconds, fractions, bits/s: what code
        holds, `model_dump`'s output), raising `ProfileError` that names the bad field."""
        return cls._validated(values, None)

    @classmethod
    def _validated(cls, values: Mapping[str, Any], context: dict | None) -> LinkProfile:
        try:
            return cls.model_validate(values, context=context)
        except ValidationError as error:
            raise ProfileError(describe_errors(error, "link profile", cls)) from None

    @property
    def is_perfect(self) -> bool:
        return self == LinkProfile()

    @property
    def mean_loss(self) -> float:
        return self.gilbert_elliott.mean_loss if self.gilbert_elliott else self.loss

    def netem_features(self) -> set[str]:
        """The netem features this profile uses beyond random loss and rate."""
        used = {
            "delay": self.delay > 0,
            "jitter": self.jitter > 0,
            "distribution": self.distribution != "uniform",
            "loss_correlation": self.loss_correlation > 0,
            "gilbert_elliott": self.gilbert_elliott is not None,
            "duplicate": self.duplicate > 0,
            "corrupt": self.corrupt > 0,
            "reorder": self.reorder > 0,
        }
        return {name for name, on in used.items() if on}

    def to_spec(self) -> dict[str, Any]:
        """The non-default fields in human units; `LinkProfile.parse(p.to_spec()) == p`."""
        spec: dict[str, Any] = {}
        for name, value in self.model_dump(exclude_defaults=True, by_alias=True).items():
            if name in ("delay", "jitter"):
                spec[name] = format_time(value)
            elif name == "rate":
                spec[name] = format_rate(value)
            elif name == "gilbert_elliott":
                spec[name] = {key: format_fraction(v) for key, v in value.items()}
            elif isinstance(value, float):
                spec[name] = format_fraction(value)
            else:
                spec[name] = value
        return spec

    def __str__(self) -> str:
        if self.is_perfect:
            return "perfect"
        return " ".join(f"{key}={value}" for key, value in self.to_spec().items())


def describe_errors(error: ValidationError, what: str, model: type[BaseModel] | None = None) -> str:
    """One line per problem: the dotted path of the field, then what is wrong and allowed."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or what
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            allowed = _fields_at(model, item["loc"][:-1]) if model else []
            message = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        lines.append(f"{path}: {message}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names (aliases where set) of the model found at `loc` inside `model`."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or not (
            isinstance(current, type) and issubclass(current, BaseModel)
        ):
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = next(
            (
                arg
                for arg in (field.annotation, *get_args(field.annotation))
                if isinstance(arg, type) and issubclass(arg, BaseModel)
            ),
            None,
        )
    if not (isinstance(current, type) and issubclass(current, BaseModel)):
        return []
    return [info.alias or name for name, info in current.model_fields.items()]
