"""The `collective` section: a kind of the registry (`testbed.collectives.registry`) with that
kind's own options, and a compression layer over it. Kinds, their options and capabilities, the
compressors and their parameters are the registry's, so each is declared in one place."""

from __future__ import annotations

import re
from functools import reduce
from operator import or_
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from netem.profile import Integer, Number
from netem.units import parse_rate, parse_time
from testbed.collectives import registry
from testbed.scenario.fields import Section

# The registry's names as the types of the fields that take them.
_COMPRESSOR_NAMES = tuple(registry.COMPRESSORS)
CompressorKind = Literal[_COMPRESSOR_NAMES]
ArcSketch = Literal[registry.ARC_SKETCHES]
Feedback = Literal[registry.FEEDBACKS]


class Compressor(Section):
    """A compression layer over the collective (docs/compression.md): the sparsifiers topk,
    randk and arc_topk (with EF21M error feedback), the quantizers int8 and int4 (group-wise,
    two-step all-reduce), or powersgd. Each kind takes only its own parameters."""

    kind: CompressorKind = Field(default="none", description=(
        f"{', '.join(_COMPRESSOR_NAMES[:-1])} or {_COMPRESSOR_NAMES[-1]}."))
    density: Number = Field(default=0.01, gt=0, le=1, description="Fraction of the values a "
                            "sparsifier sends.")
    sketch: ArcSketch = Field(default="projection", description="arc_topk: how the workers "
                              "agree on a pattern: projection (the paper's: each weight "
                              "matrix's rows projected on a shared random matrix, whole rows "
                              "kept) or marginal (row and column energies, single coordinates "
                              "kept).")
    sketch_rank: Integer = Field(default=4, ge=1, description="arc_topk with sketch projection: "
                                 "columns of the random projection (the paper's r).")
    block: Integer = Field(default=64, ge=1, description="arc_topk without the parameters' shapes "
                           "(a DDP bucket): values per row of the sketch.")
    group_size: Integer = Field(default=128, ge=2, le=65536, multiple_of=2, description=(
        "int8/int4: values per scale (32-256 usual)."))
    symmetric: bool = Field(default=True, description="int8/int4: symmetric (scale) or "
                            "asymmetric (scale and minimum) per group.")
    stochastic: bool = Field(default=False, description="int8/int4: stochastic rounding "
                             "(unbiased) instead of nearest.")
    error_feedback: bool = Field(default=True, description="Sparsifiers: error feedback (which: "
                                 "`feedback`); powersgd: its error memory.")
    feedback: Feedback = Field(default="ef21m", description="Sparsifiers' error feedback: "
                               "ef21m (momentum, a shared estimate, the first step sent whole) "
                               "or ef14 (each worker's own error).")
    momentum: Number = Field(default=1.0, gt=0, le=1, description="EF21M's eta (1: EF21; the "
                             "job's optimizer keeps its own momentum).")
    resync_every: Integer = Field(default=0, ge=0, description="Sparsifiers: every N calls, set "
                                  "the shared EF21M estimate to the exact mean (0: never).")
    rank: Integer = Field(default=2, ge=1, description="powersgd: rank of the approximation.")
    seed: Integer = Field(default=0, ge=0, description="randk: the shared seed; arc_topk: the "
                          "shared projections; int8/int4: stochastic rounding; powersgd: the first "
                          "Q.")

    @model_validator(mode="after")
    def _own_parameters(self) -> Compressor:
        allowed = registry.COMPRESSORS[self.kind].parameters
        for name in sorted(self.model_fields_set - {"kind"}):
            if name not in allowed:
                raise ValueError(f"{name}: not a parameter of {self.kind}; allowed: "
                                 f"{', '.join(allowed) or 'none'}")
        if self.feedback == "ef14" and (self.momentum != 1.0 or self.resync_every):
            raise ValueError("momentum and resync_every are EF21M's: feedback ef14 keeps no "
                             "momentum and no shared estimate")
        return self

    def parameters(self) -> dict[str, Any]:
        """The parameters given, for `testbed.collectives.compression.wrap(inner, kind, ...)`."""
        return self.model_dump(exclude={"kind"}, exclude_unset=True)


class _Collective(registry.CollectiveOptions):
    kind: str  # and, after the kind's own options, `compressor: Compressor`

    def options(self) -> dict[str, Any]:
        """The options given, for `testbed.collectives.place(kind, placement, options)`; the
        registry entry adds the placement's."""
        return self.model_dump(exclude={"kind", "compressor"}, exclude_unset=True)

    @property
    def capabilities(self) -> registry.Capabilities:
        return registry.kind(self.kind).capabilities


def option_time(value: Any) -> Any:
    """A collective option in seconds, written as a number of them or with a unit ('2s',
    '500ms') as every other time of a scenario; what is no time ('auto', null) is left to the
    option's own validation."""
    return parse_time(value) if isinstance(value, str) and re.search("[0-9]", value) else value


def option_rate(value: Any) -> Any:
    """A collective option in bits/s, written as a number of them or with a unit ('100mbit')
    as a link's rate; what is no rate (null) is left to the option's own validation."""
    return parse_rate(value) if isinstance(value, str) and re.search("[0-9]", value) else value


# The options whose description starts with their unit (as the registry describes each), and
# what then reads them.
_UNITS = {"seconds": option_time, "bits/s": option_rate}
_UNIT = re.compile(r"(?:least |most )?(seconds|bits/s)\b", re.IGNORECASE)


def _with_units(options: type[registry.CollectiveOptions]) -> dict[str, Any]:
    """The options in seconds or bits/s, also taking a unit: their types, read first by
    `option_time` or `option_rate`, and their own field (bounds, default, description)."""
    fields: dict[str, Any] = {}
    for name, info in options.model_fields.items():
        unit = _UNIT.match(info.description or "")
        if unit:
            read = _UNITS[unit.group(1).lower()]
            fields[name] = (Annotated[info.annotation, BeforeValidator(read)],
                            FieldInfo.merge_field_infos(info))
    return fields


def _collective_model(entry: registry.Kind) -> type[_Collective]:
    model = create_model(
        f"{entry.name.capitalize()}Collective", __base__=(entry.options, _Collective),
        kind=(Literal[entry.name], ...),
        compressor=(Compressor, Field(default=Compressor(), description="Compression over the "
                                      "collective (kind none: off); docs/compression.md.")),
        **_with_units(entry.options))
    model.__doc__ = f"Collective {entry.name!r}: {entry.summary}."
    return model


def collective_mapping(value: Any) -> Any:
    """The section is a mapping: `collective: lossy`, a natural shorthand, is refused with the
    mapping it stands for."""
    if isinstance(value, str):
        kinds = registry.kinds()
        if value in kinds:
            raise ValueError(f"expected a mapping: write collective: {{kind: {value}}} (that "
                             "kind's options go beside kind)")
        raise ValueError(f"expected a mapping {{kind: ...}}, kind one of {', '.join(kinds)}; "
                         f"got {value!r}")
    return value


COLLECTIVES: dict[str, type[_Collective]] = {name: _collective_model(registry.kind(name))
                                             for name in registry.kinds()}
CollectiveSpec = Annotated[reduce(or_, COLLECTIVES.values()), Field(discriminator="kind"),
                           BeforeValidator(collective_mapping)]
