"""`LinkProfile`: one validated, immutable description of what a link does to packets.

It covers everything netem does (delay, jitter and its distribution, named or made from
measured delays, loss, bursty Gilbert-Elliott loss, ECN marking, duplication, corruption,
reordering, rate with its overheads, slots, queue limit, the seed of its random numbers), but
4-state loss. Values are kept on the kernel's own grid (nanoseconds, 32-bit probabilities, whole
bytes per second) so that a profile applied to the kernel and read back compares equal to the
original.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
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

from netem.distribution import sample_table
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
S32_MIN, S32_MAX = -(2**31), 2**31 - 1
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1
MAX_S64_SECONDS = (2**63 - 1) // 10**9  # the whole seconds a signed 64-bit count of ns holds
MAX_RATE = U64_MAX * 8 // 10**12 * 10**12  # bits/s: netem's u64 of bytes/s, in whole tbit
TIMES = ("delay", "jitter", "min_delay", "max_delay")  # fields in seconds, shown with a unit
# The ECN field (RFC 3168: the low two bits of IPv4's TOS, IPv6's traffic class): what `ecn`
# marks (CE) on a packet that says it is ECN-capable (ECT(0)).
ECN_MASK, ECT_0, ECN_CE = 0b11, 0b10, 0b11


def _not_boolean(expected: str) -> BeforeValidator:
    """Refuse a boolean where a number is meant: Python counts True as 1, and YAML reads
    yes/no/on/off as booleans, so a lax model would take `gap: false` for 0 (a JSON Schema's
    `integer` and `number` refuse them too)."""
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected {expected}, got {str(value).lower()}")
        return value
    return BeforeValidator(check)


# The plain numbers of every validated model (profiles, scenarios, collectives, jobs). An
# optional number with bounds writes them before the check, `Annotated[int, Field(ge=0),
# AN_INTEGER] | None`: so pydantic bounds the number itself (the JSON Schema's `minimum`, a big
# bound printed exactly), not the check's result.
AN_INTEGER, A_NUMBER = _not_boolean("an integer"), _not_boolean("a number")
Integer = Annotated[int, AN_INTEGER]
Number = Annotated[float, A_NUMBER]


def _on_grid(value: float) -> float:
    """Probabilities and seconds are kept to 9 decimals: the kernel's u32/ns grid is finer."""
    return round(value, 9)


# Validation context of human input (`LinkProfile.parse`, scenario files): a link's times and
# rate need their unit there; code that builds profiles in base units validates without it.
HUMAN = {"human": True}


def _human(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("human"))


def _kept(value: float, given: Any, least: str, info: ValidationInfo) -> float:
    """`value` on the grid; in human input, refused where it is not 0 but the grid makes it 0
    (it would vanish from the link without a word)."""
    kept = _on_grid(value)
    if value and not kept and _human(info):
        raise ValueError(f"expected 0 or at least {least} (less would be 0 to netem), got "
                         f"{given!r}")
    return kept


def _link_time(value: Any, info: ValidationInfo) -> float:
    seconds = _kept(parse_time(value, unit_required=_human(info)), value, "1ns", info)
    if seconds > MAX_S64_SECONDS:
        raise ValueError(f"expected at most {MAX_S64_SECONDS}s (netem keeps a time as signed "
                         f"64-bit nanoseconds), got {value!r}")
    return seconds


def _fraction(value: Any, info: ValidationInfo) -> float:
    return _kept(parse_fraction(value), value, "0.0000001%", info)


def _link_rate(value: Any, info: ValidationInfo) -> int:
    bits = parse_rate(value, unit_required=_human(info))
    if bits > MAX_RATE:
        raise ValueError(f"expected at most {MAX_RATE // 10**12}tbit (netem keeps a rate as "
                         f"64-bit bytes per second), got {value!r}")
    return max(8, bits // 8 * 8)


Seconds = Annotated[float, BeforeValidator(lambda v: _on_grid(parse_time(v)))]
# A link's time, on the kernel's grid and within its s64 nanoseconds; a unit required in human
# input.
LinkTime = Annotated[float, BeforeValidator(_link_time)]
Fraction = Annotated[float, BeforeValidator(_fraction)]  # a probability netem keeps
BitsPerSecond = Annotated[int, BeforeValidator(_link_rate)]  # a unit required in human input


class ProfileError(ValueError):
    """A link profile that cannot be built; the message names the field and what is allowed."""


def _within_netem(jitter: float) -> float:
    if jitter > MAX_JITTER:
        raise ValueError(f"netem takes a jitter of at most {MAX_JITTER}s, got {jitter}s")
    return jitter


class SampledDistribution(BaseModel):
    """A measured delay distribution: netem's table made from a file of delays, one number a
    line or a CSV file's `column`, the way iproute2's maketable makes it (netem.distribution).

    The file is read when the distribution is made; `digest` then names the table it gave.
    Given a digest (a dump of the profile, a read-back), the file is not read again: the table
    is sent only if the file still gives that digest (`table`). `unit` is the values' time unit
    (required in human input; seconds in base units): it scales the samples' mean and standard
    deviation, which become the delay and jitter where those are not given.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples: str
    column: str | None = None
    unit: str | None = None
    digest: str = ""  # made from the file where not given: never empty once validated

    @model_validator(mode="before")
    @classmethod
    def _tabulated(cls, data: Any, info: ValidationInfo) -> Any:
        if (not isinstance(data, Mapping) or data.get("digest") or "samples" not in data
                or set(data) - set(cls.model_fields)):
            return data  # made already, or the fields' own validation says what is wrong
        if data.get("unit") is None and _human(info):
            raise ValueError("give the unit of the samples' values, e.g. unit: ms (a bare "
                             "number would be seconds)")
        made = sample_table(str(data["samples"]), data.get("column"))
        return {**data, "samples": str(Path(data["samples"]).resolve()), "digest": made.digest}

    @field_validator("unit")
    @classmethod
    def _time_unit(cls, value: str | None) -> str | None:
        if value is not None and not _is_time_unit(value):
            raise ValueError(f"expected a time unit such as 'ms', 'us' or 's', got {value!r}")
        return value

    def table(self) -> tuple[int, ...]:
        """The table to send: the file's, if it still gives the digest this profile has."""
        made = sample_table(self.samples, self.column)
        if made.digest != self.digest:
            raise ValueError(
                f"{self.samples}: the file changed since the profile was made (its table's "
                f"digest is {made.digest} now, {self.digest} then): make the profile again"
            )
        return made.table


def _is_time_unit(unit: str) -> bool:
    if not unit.isalpha():
        return False
    try:
        parse_time(f"1{unit}")
    except ValueError:
        return False
    return True


def _distribution(value: Any, info: ValidationInfo) -> Any:
    """A table's name or {samples: FILE, ...}, checked here so that errors name the field."""
    if isinstance(value, str):
        if value not in DISTRIBUTIONS:
            raise ValueError(
                f"expected one of {', '.join(DISTRIBUTIONS)} or {{samples: FILE}}, got {value!r}"
            )
        return value
    if isinstance(value, Mapping):
        return SampledDistribution.model_validate(value, context=info.context)
    if isinstance(value, SampledDistribution):
        return value
    raise ValueError(f"expected one of {', '.join(DISTRIBUTIONS)} or {{samples: FILE}}, got "
                     f"{value!r}")


Distribution = Annotated[
    Literal["uniform", "normal", "pareto", "paretonormal"] | SampledDistribution,
    BeforeValidator(_distribution),
]


def _delay_from_samples(data: Any, info: ValidationInfo) -> Any:
    """`data` with the delay and jitter of its samples distribution where they are not given:
    the samples' mean and standard deviation, by which netem scales the table. Left as it is
    where the samples cannot be read: the distribution's own validation then says why."""
    given = data.get("distribution") if isinstance(data, Mapping) else None
    if (not isinstance(given, Mapping) or given.get("digest") or "samples" not in given
            or ("delay" in data and "jitter" in data)):
        return data
    unit = given.get("unit")
    if (unit is None and _human(info)) or (unit is not None and not _is_time_unit(str(unit))):
        return data
    try:
        made = sample_table(str(given["samples"]), given.get("column"))
    except ValueError:
        return data
    scale = parse_time(f"1{unit}") if unit is not None else 1.0
    measured = {"delay": made.mean * scale, "jitter": made.stdev * scale}
    return {**{name: f"{round(value * 1e9)}ns" for name, value in measured.items()}, **data}


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


class Slot(BaseModel):
    """netem's slots, as on Wi-Fi, LTE or DOCSIS links: packets wait for the next slot and leave
    together, at most `max_packets` packets and `max_bytes` bytes a slot (0: no limit).

    Slots start `min_delay` to `max_delay` apart, uniformly (`max_delay` is `min_delay` unless
    given), or `delay` +- `jitter` apart as `distribution` shapes it (a table's name or
    {samples: FILE}, whose mean and standard deviation are the delay and jitter unless given).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_delay: LinkTime = 0.0
    max_delay: LinkTime = 0.0
    distribution: Distribution | None = None
    delay: LinkTime = 0.0
    jitter: LinkTime = 0.0
    max_packets: Integer = Field(default=0, ge=0, le=S32_MAX)  # netem's 'no limit' (S32_MAX) is 0
    max_bytes: Integer = Field(default=0, ge=0, le=S32_MAX)

    @model_validator(mode="before")
    @classmethod
    def _filled(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, Mapping) and "min_delay" in data and "max_delay" not in data:
            data = {**data, "max_delay": data["min_delay"]}
        return _delay_from_samples(data, info)

    @field_validator("jitter")
    @classmethod
    def _jitter_within_netem(cls, value: float) -> float:
        return _within_netem(value)

    @field_validator("max_packets", "max_bytes")
    @classmethod
    def _no_limit_is_zero(cls, value: int) -> int:
        return 0 if value == S32_MAX else value

    @model_validator(mode="after")
    def _one_kind(self) -> Slot:
        if self.distribution is None:
            if self.delay or self.jitter:
                raise ValueError("delay and jitter are a slot distribution's: give its "
                                 "distribution too, or min_delay and max_delay instead")
            if self.max_delay < self.min_delay:
                raise ValueError(f"max_delay ({format_time(self.max_delay)}) must be at least "
                                 f"min_delay ({format_time(self.min_delay)})")
            if self.max_delay == 0:
                raise ValueError("give min_delay and max_delay (not both 0), or a distribution "
                                 "with its delay and jitter")
        else:
            if self.min_delay or self.max_delay:
                raise ValueError("give either min_delay and max_delay or a distribution, not both")
            if self.jitter == 0:
                raise ValueError("a slot distribution needs a jitter: it shapes the time between "
                                 "slots")
        return self


class LinkProfile(BaseModel):
    """What one directed link does to packets. All fields default to a perfect link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delay: LinkTime = 0.0
    jitter: LinkTime = 0.0
    delay_correlation: Fraction = 0.0
    distribution: Distribution = "uniform"
    loss: Fraction = 0.0
    loss_correlation: Fraction = 0.0
    gilbert_elliott: GilbertElliott | None = None
    ecn: bool = False  # mark ECN-capable packets (CE) instead of dropping them
    duplicate: Fraction = 0.0
    duplicate_correlation: Fraction = 0.0
    corrupt: Fraction = 0.0
    corrupt_correlation: Fraction = 0.0
    reorder: Fraction = 0.0
    reorder_correlation: Fraction = 0.0
    gap: Integer = Field(default=0, ge=0, le=U32_MAX)  # 1 behaves as 0 in netem; kept as 0
    rate: BitsPerSecond | None = None
    packet_overhead: Integer = Field(default=0, ge=S32_MIN, le=S32_MAX)  # bytes, for the rate
    cell_size: Integer = Field(default=0, ge=0, le=U32_MAX)  # bytes; 0: no cells
    cell_overhead: Integer = Field(default=0, ge=S32_MIN, le=S32_MAX)  # bytes per cell
    slot: Slot | None = None
    limit: Integer = Field(default=DEFAULT_LIMIT, ge=1, le=U32_MAX)
    # Of netem's random numbers.
    seed: Annotated[int, Field(ge=0, le=U64_MAX), AN_INTEGER] | None = Field(default=None)

    @model_validator(mode="before")
    @classmethod
    def _measured_delay(cls, data: Any, info: ValidationInfo) -> Any:
        return _delay_from_samples(data, info)

    @field_validator("gap")
    @classmethod
    def _gap_on_kernel_grid(cls, value: int) -> int:
        return 0 if value == 1 else value

    @field_validator("jitter")
    @classmethod
    def _jitter_within_netem(cls, value: float) -> float:
        return _within_netem(value)

    @model_validator(mode="after")
    def _consistent(self) -> LinkProfile:
        if self.jitter > 0 and self.delay == 0:
            raise ValueError("jitter needs a delay: netem varies the delay around its mean")
        if self.distribution != "uniform" and self.jitter == 0:
            raise ValueError(
                f"distribution {_name(self.distribution)} needs a jitter: it shapes the delay "
                "variation"
            )
        if self.loss > 0 and self.gilbert_elliott is not None:
            raise ValueError("give either loss (random) or gilbert_elliott (bursty), not both")
        if self.ecn and self.loss == 0 and self.gilbert_elliott is None:
            raise ValueError("ecn needs a loss model (loss or gilbert_elliott): netem marks the "
                             "ECN-capable packets it would drop")
        if (self.reorder > 0 or self.gap > 0) and self.delay == 0:
            raise ValueError("reorder needs a delay: netem reorders by sending some packets early")
        if self.gap > 0 and self.reorder == 0:
            raise ValueError("gap needs reorder > 0")
        if (self.packet_overhead or self.cell_size or self.cell_overhead) and self.rate is None:
            raise ValueError("packet_overhead, cell_size and cell_overhead need a rate: they "
                             "change the size each packet takes of it")
        if self.cell_overhead and not self.cell_size:
            raise ValueError("cell_overhead needs a cell_size: it is added to every cell")
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
            "ecn": self.ecn,
            "packet_overhead": self.packet_overhead != 0,
            "cell_size": self.cell_size > 0,
            "cell_overhead": self.cell_overhead != 0,
            "slot": self.slot is not None,
        }
        return {name for name, on in used.items() if on}

    def to_spec(self) -> dict[str, Any]:
        """The non-default fields in human units; `LinkProfile.parse(p.to_spec()) == p`."""
        return {name: _human_value(name, value)
                for name, value in self.model_dump(exclude_defaults=True, by_alias=True).items()}

    def __str__(self) -> str:
        if self.is_perfect:
            return "perfect"
        return " ".join(f"{key}={value}" for key, value in self.to_spec().items())


def _human_value(name: str, value: Any) -> Any:
    """A field's value (as `model_dump` gives it) in human units."""
    if name in TIMES:
        return format_time(value)
    if name == "rate":
        return format_rate(value)
    if name == "gilbert_elliott":
        return {key: format_fraction(v) for key, v in value.items()}
    if name == "slot":
        return {key: _human_value(key, v) for key, v in value.items()}
    if isinstance(value, float):
        return format_fraction(value)
    return value


def _name(distribution: str | SampledDistribution) -> str:
    if isinstance(distribution, SampledDistribution):
        return f"of samples {distribution.samples}"
    return repr(distribution)


def derive_seed(run_seed: int, *parts: str | int) -> int:
    """A link's own seed (for `LinkProfile.seed`) from a run's and what names the link (its
    endpoints, say): a hash of them (BLAKE2b, not Python's `hash`), so the same everywhere and
    every time, and unrelated to any other link's: adding or changing a link leaves the
    others' seeds as they were."""
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise TypeError(f"run_seed: expected an integer, got {run_seed!r}")
    words = json.dumps([run_seed, *parts], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(words, digest_size=8).digest(), "big")


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
