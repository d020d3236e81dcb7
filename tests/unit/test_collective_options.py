"""A collective's options are checked once, by its kind's model in the registry: what the model
accepts (what `testbed scenario check` lets through) the kind's constructor takes, at the
bounds of every field, and a rule across fields is the model's, so a scenario is refused when
it is checked rather than when its workers start."""

from __future__ import annotations

from typing import Any

import pytest
from loopback import free_ports
from pydantic import ValidationError

from testbed import collectives
from testbed.collectives import registry
from testbed.collectives.lossy import Lossy
from testbed.scenario import ScenarioError, load_scenario


def bound_values(schema: dict[str, Any]) -> list[Any]:
    """The values at the bounds of one field's JSON Schema: each numeric bound (one unit inside
    an exclusive one: the float just above 0 s is no timeout a socket can keep), each choice,
    null and both booleans where allowed."""
    values: list[Any] = []
    for member in schema.get("anyOf", [schema]):
        values.extend([member["const"]] if "const" in member else member.get("enum", []))
        if member.get("type") == "null":
            values.append(None)
        elif member.get("type") == "boolean":
            values.extend([True, False])
        for bound, inside in (("minimum", 0), ("exclusiveMinimum", 1), ("maximum", 0),
                              ("exclusiveMaximum", -1)):
            if bound in member:
                values.append(member[bound] + inside)
    return values


def accepted_samples(kind: str) -> list[tuple[str, Any]]:
    """(field, value) for every field of `kind`'s options at each of its bounds that the model
    accepts with the other fields at their defaults (one at a bound may break a rule across
    fields: the model refuses it, and rightly)."""
    model = registry.kind(kind).options
    samples = []
    for name, schema in model.model_json_schema()["properties"].items():
        for value in bound_values(schema):
            try:
                model(**{name: value})
            except ValidationError:
                continue
            samples.append((name, value))
    return samples


CASES = [pytest.param(kind, name, value, id=f"{kind}-{name}={value!r}")
         for kind in registry.kinds() for name, value in accepted_samples(kind)]


def test_every_field_of_every_kind_is_sampled_at_a_bound():
    sampled = {(case.values[0], case.values[1]) for case in CASES}
    for kind in registry.kinds():
        for name in registry.kind(kind).options.model_fields:
            assert (kind, name) in sampled, f"{kind}.{name}: no value at a bound was accepted"


@pytest.mark.parametrize(("kind", "name", "value"), CASES)
def test_what_the_model_accepts_the_constructor_takes(kind, name, value, monkeypatch):
    """One worker of one, placed as a run places it, with the options as the model hands
    them on."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo would set it for 127.0.0.1 for good
    ports = dict(zip(("collective", "stream", "store"), free_ports(3), strict=True))
    placement = registry.Placement(rank=0, world=1, hosts=["127.0.0.1"],
                                   port=lambda port, rank: ports[port])
    options = registry.kind(kind).options(**{name: value}).model_dump(exclude_unset=True)
    collectives.place(kind, placement, options).close()


CROSSED = {"deadline_floor": 2, "deadline_initial": 1}
NAMED = r"deadline_initial: expected deadline_floor to deadline_ceiling \(2\.0 to 5\.0\), got 1\.0"


def test_a_rule_across_fields_is_the_models_and_names_the_field():
    with pytest.raises(ValidationError, match=NAMED):
        registry.LossyOptions(**CROSSED)
    with pytest.raises(ScenarioError) as refused:  # what `testbed scenario check` does
        load_scenario("name: x\nworkers: 2\ncollective: {kind: lossy, deadline_floor: 2, "
                      "deadline_initial: 1}\n")
    assert any(p.path == "collective" and p.line == 3 and "deadline_initial: expected "
               "deadline_floor to deadline_ceiling" in p.message
               for p in refused.value.problems), refused.value.problems
    with pytest.raises(ValueError, match=NAMED):  # a constructor called directly: the model's
        Lossy(0, 1, addresses=[("127.0.0.1", 0)], **CROSSED)
