"""Fuzzing the scenario loader and the unit parsers: whatever document or string comes in, the
answer is a scenario, or the one error type that names what is wrong (`ScenarioError`, each
problem with its field; `ValueError` from a unit parser); never another exception."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netem.profile import LinkProfile, ProfileError
from netem.units import parse_fraction, parse_rate, parse_time
from testbed.scenario import Scenario, ScenarioError, load_scenario, scenario_files

SHIPPED = [yaml.safe_load(path.read_text()) for path in scenario_files()]
# Derandomised: CI checks the same examples every time (a larger random search ran before they
# were fixed; a new bug is found by raising max_examples, not by chance in CI).
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["10ms", "5%", "100mbit", "-1%", "150%", "5", "all", "a|b",
                                     "lossy", "ring", "0->1", "1e309", "NaN", ""]))
documents = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=10), children, max_size=4)),
    max_leaves=25)


def load(data: Any) -> Scenario | ScenarioError:
    """Load `data` as a scenario file's text: a scenario, or the error (anything else fails)."""
    try:
        text = yaml.safe_dump(data)
    except yaml.YAMLError:
        pytest.skip("not representable as YAML")
    try:
        return load_scenario(text if "\n" in text else text + "\n")
    except ScenarioError as error:
        assert error.problems and all(problem.message for problem in error.problems), error
        return error


@FUZZ
@given(documents)
def test_any_document_loads_or_names_what_is_wrong(data):
    load(data)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def mutated(draw) -> Any:
    """A shipped scenario with one value replaced, one key dropped or one junk key added."""
    data = copy.deepcopy(draw(st.sampled_from(SHIPPED)))
    path = draw(st.sampled_from(_paths(data)[1:]))
    *parents, last = path
    holder = data
    for part in parents:
        holder = holder[part]
    action = draw(st.sampled_from(["replace", "drop", "junk"]))
    if action == "replace":
        holder[last] = draw(documents)
    elif action == "drop" and isinstance(holder, dict):
        del holder[last]
    elif isinstance(holder, dict):
        holder[draw(st.text(max_size=8))] = draw(scalars)
    return data


@FUZZ
@given(mutated())
def test_a_mutated_shipped_scenario_loads_or_names_the_field(data):
    outcome = load(data)
    if isinstance(outcome, ScenarioError):
        assert all(problem.path or problem.line is None for problem in outcome.problems)


@FUZZ
@given(st.one_of(st.text(max_size=20), scalars))
def test_unit_parsers_take_a_value_or_say_what_is_allowed(value):
    for parse in (parse_time, parse_fraction, parse_rate):
        for strict in ((False, True) if parse is not parse_fraction else (False,)):
            try:
                result = (parse(value, unit_required=True) if strict else parse(value))
            except ValueError as error:
                assert "expected" in str(error) or "unit" in str(error), error
            else:
                assert result >= 0


@FUZZ
@given(st.dictionaries(st.sampled_from(["delay", "jitter", "loss", "rate", "duplicate",
                                        "corrupt", "reorder", "gap", "limit", "distribution",
                                        "loss_correlation"]), scalars, max_size=5))
def test_a_link_profile_is_made_or_refused_naming_its_field(values):
    try:
        LinkProfile.parse(values)
    except ProfileError as error:
        assert str(error), values
