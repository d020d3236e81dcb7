"""The JSON Schema of a scenario file (for editors: completion, inline errors), generated from the
models. Where a field's before-validator takes more than its type (human units, one item for a
list, a count for `workers`, a link as text), the schema says what it takes, from the rules the
loader applies: the unit grammar's own patterns (`netem.units.pattern`) and the models' bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, get_args

from pydantic import BeforeValidator
from pydantic.json_schema import GenerateJsonSchema

from netem.profile import BitsPerSecond, Fraction, LinkTime, Seconds
from netem.units import QUANTITIES, TIME_HELP, pattern
from testbed.scenario.collective import option_rate, option_time
from testbed.scenario.fields import as_list
from testbed.scenario.links import ALL
from testbed.scenario.model import Scenario
from testbed.scenario.sections import TOP_LEVEL, Workers, byte_size, worker_count
from testbed.scenario.topology import LINK_HELP, LINK_TEXT, link_text
from testbed.train.config import TrainConfig, parse_threshold

Wider = Callable[[dict], dict]  # the schema of what a validator takes, from its inner type's


def _before(annotated: Any) -> Callable:
    return next(m.func for m in get_args(annotated)[1:] if isinstance(m, BeforeValidator))


def _excludes_zero(number: dict) -> bool:
    return number.get("exclusiveMinimum", -1) >= 0 or number.get("minimum", 0) > 0


def _quantity(kind: str, *, unit_required: bool = False) -> Wider:
    """A value of `kind` (`netem.units.QUANTITIES`): a number within the field's bounds and the
    quantity's own (with `unit_required`, only 0, where allowed), or a string with its unit."""
    quantity = QUANTITIES[kind]
    help_text = quantity.help + (
        f" (with its unit: a bare number would be {quantity.base})" if unit_required else "")

    def wider(inner: dict) -> dict:
        positive = quantity.positive or _excludes_zero(inner)
        text = {"type": "string",
                "pattern": pattern(kind, unit_required=unit_required, positive=positive)}
        if unit_required:
            return {"anyOf": [text] if positive else [{"const": 0}, text],
                    "description": help_text}
        number = dict(inner)
        if quantity.positive and not positive:
            number["exclusiveMinimum"] = 0
        elif max(inner.get("minimum", -1), inner.get("exclusiveMinimum", -1)) < 0:
            number["minimum"] = 0
        highest = min(inner.get("maximum", math.inf), inner.get("exclusiveMaximum", math.inf))
        if quantity.maximum is not None and highest > quantity.maximum:
            number["maximum"] = quantity.maximum
        return {"anyOf": [number, text], "description": help_text}

    return wider


def _each_number(wider: Wider) -> Wider:
    """`wider` applied to the number a schema takes, alone or among a union's members (X |
    None, X | 'auto'), the other members kept."""

    def apply(inner: dict) -> dict:
        if "anyOf" not in inner:
            return wider(inner)
        members = [widened for member in inner["anyOf"] for widened in (
            wider(member)["anyOf"] if member.get("type") == "number" else [member])]
        return {**inner, "anyOf": members}

    return apply


_TIME = _quantity("time")
_COUNT = {key: value for key, value in Workers.model_json_schema()["properties"]["count"].items()
          if key != "title"}
_WIDER: dict[Callable, Wider] = {
    _before(Seconds): _TIME,
    _before(LinkTime): _quantity("time", unit_required=True),
    _before(Fraction): _quantity("fraction"),
    _before(BitsPerSecond): _quantity("rate", unit_required=True),
    byte_size: _quantity("size", unit_required=True),
    parse_threshold: lambda inner: {**_each_number(_TIME)(inner),
                                    "description": f"'auto' or {TIME_HELP}"},
    option_time: _each_number(_TIME),
    option_rate: _each_number(_quantity("rate")),
    as_list: lambda inner: {"anyOf": [inner.get("items", {}), inner]},
    link_text: lambda inner: {"anyOf": [{"type": "string", "pattern": LINK_TEXT,
                                         "description": LINK_HELP}, {"const": ALL}, inner]},
    worker_count: lambda inner: {"anyOf": [_COUNT, inner]},
}


class _SchemaGenerator(GenerateJsonSchema):
    def generate_inner(self, schema: Any) -> Any:
        """A bound on a type with a before-validator (`Annotated[Seconds, Field(gt=0)]`) is a
        validator after it to pydantic, whose JSON Schema names it by pydantic's own name
        ('gt', no keyword); it bounds the number the before-validator gives, so it goes there."""
        if schema["type"] == "function-after" and schema["schema"]["type"] == "function-before":
            bounds = getattr(schema["function"]["function"], "keywords", None)
            if bounds and set(bounds) <= {"gt", "ge", "lt", "le"}:
                before = schema["schema"]
                return self.generate_inner({**before, "schema": {**before["schema"], **bounds}})
        return super().generate_inner(schema)

    def function_before_schema(self, schema: Any) -> dict:
        inner = self.generate_inner(schema["schema"])
        wider = _WIDER.get(schema["function"]["function"])
        return wider(inner) if wider else inner


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file (for editors: completion, inline errors)."""
    schema = Scenario.model_json_schema(schema_generator=_SchemaGenerator)
    job = schema["$defs"][TrainConfig.__name__]["properties"]
    for name in TOP_LEVEL:  # the job's, but set at the top level of a scenario
        del job[name]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "testbed scenario",
    }
