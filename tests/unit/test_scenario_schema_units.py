"""The loader and the JSON Schema take the same values: one table of times, rates, sizes,
fractions and worker counts goes through both, and the schema's unit patterns, generated from
the parsers' grammar (`netem.units.pattern`), take exactly the strings the parsers take."""

from __future__ import annotations

import re

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from netem.units import (
    QUANTITIES,
    parse_fraction,
    parse_rate,
    parse_size,
    parse_time,
    pattern,
)
from testbed.scenario import ScenarioError, json_schema, load_scenario

DELAY = "topology: {{default: {{delay: {}}}}}"
AT = "timeline: [{{at: {}, kill: 1}}]"
OVER = "timeline: [{{at: 1s, ramp_link: {{to: {{loss: 2%}}, over: {}}}}}]"
RATE = "topology: {{default: {{rate: {}}}}}"
MAX_BYTES = "capture: {{max_bytes: {}}}"
LOSS = "topology: {{default: {{loss: {}}}}}"
THRESHOLD = "job: {{micro_batches: 2, drop_compute: {{threshold: {}}}}}"
WORKERS = "workers: {}"
TIMEOUT = "collective: {{kind: ring, timeout: {}}}"
SETTLE = "collective: {{kind: lossy, settle: {}}}"
PACING = "collective: {{kind: lossy, rate: {}}}"

# (field, value as written in YAML, taken): what the loader does, so what the schema must do.
TABLE = [
    *((DELAY, value, True) for value in (
        "10ms", "10Ms", "1.5S", "250usec", "1e-3s", ".5ms", "10 ms", "0", "'0'", "0.0")),
    *((DELAY, value, False) for value in (
        "5", "'5'", "-1ms", "-0ms", "5.ms", "10 parsecs", "ms", "''", "true")),
    *((AT, value, True) for value in ("30", "'30'", "30s", "1.5MS", "0")),
    *((AT, value, False) for value in ("-1s", "-1", "30 minutes")),
    *((OVER, value, True) for value in ("2s", "0.5", "1e-3")),
    *((OVER, value, False) for value in ("0s", "0", "0.0", "'0'", "-2s")),
    *((RATE, value, True) for value in ("100mbit", "100MBit", "1tbit", "1.5gbit")),
    *((RATE, value, False) for value in (
        "100", "'100'", "0mbit", "0", "-1mbit", "100 mbits", "1tbps", "10MBPS", "100mbps",
        "1kbps", "8bps")),
    *((MAX_BYTES, value, True) for value in ("20MB", "1MiB", "1mib", "512kB", "1kB", "2GB")),
    *((MAX_BYTES, value, False) for value in ("5", "'5'", "5000", "0", "0MB", "-1MB", "1TB")),
    *((LOSS, value, True) for value in ("5%", "5 %", "0.05", "'0.05'", "100%", "0", "1")),
    *((LOSS, value, False) for value in ("150%", "-1%", "-0%", "1.5", "5.%", "5%%", "'2'")),
    *((THRESHOLD, value, True) for value in ("10Ms", "0.01", "auto")),
    *((THRESHOLD, value, False) for value in ("-1ms", "never")),
    *((WORKERS, value, True) for value in ("4", "256", "{count: 3}")),
    *((TIMEOUT, value, True) for value in ("2s", "500ms", "2", "'2'", "1.5")),
    *((TIMEOUT, value, False) for value in ("0s", "0", "-1s", "2 parsecs", "null")),
    *((SETTLE, value, True) for value in ("auto", "5ms", "0.005", "null")),
    *((SETTLE, value, False) for value in ("soon", "0ms", "-5ms")),
    *((PACING, value, True) for value in ("100mbit", "1e8", "null")),
    *((PACING, value, False) for value in ("100mbps", "0mbit", "fast")),
    *((WORKERS, value, False) for value in (
        "257", "100000", "0", "'4'", "true", "2.5", "{count: 300}")),
]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json_schema())


@pytest.mark.parametrize(("field", "value", "taken"), TABLE,
                         ids=[field.format(value) for field, value, _ in TABLE])
def test_the_loader_and_the_schema_agree(validator, field: str, value: str, taken: bool):
    text = field.format(value)
    try:
        load_scenario(text + "\n")
    except ScenarioError:
        loaded = False
    else:
        loaded = True
    valid = validator.is_valid(yaml.safe_load(text))
    assert (loaded, valid) == (taken, taken)


def test_the_schema_has_no_keyword_that_is_pydantic_s_only():
    """A bound pydantic could not put in JSON Schema's terms shows as its own name ('gt')."""

    def keys(node: object) -> set[str]:
        if isinstance(node, dict):
            return set(node) | {key for value in node.values() for key in keys(value)}
        if isinstance(node, list):
            return {key for value in node for key in keys(value)}
        return set()

    assert not keys(json_schema()["$defs"]) & {"gt", "ge", "lt", "le", "multiple_of"}


PARSERS = {"time": parse_time, "rate": parse_rate, "size": parse_size}
CASES = [("time", False, False), ("time", True, False), ("time", False, True),
         ("rate", True, False), ("size", True, False), ("fraction", False, False)]


def _parses(kind: str, text: str, unit_required: bool, positive: bool) -> bool:
    try:
        value = (parse_fraction(text) if kind == "fraction" else
                 PARSERS[kind](text, unit_required=unit_required))
    except ValueError:
        return False
    return value > 0 or not positive


# Strings near the grammar: a number (or not quite one: '5.', '.', '-'), spaces, and a unit of
# any quantity, in any case, or none, or one no table has.
_NUMBERS = st.from_regex(r"-?[0-9]{0,3}\.?[0-9]{0,3}([eE][-+]?[0-9]{1,2})?", fullmatch=True)
_UNITS = st.sampled_from(sorted({unit for quantity in QUANTITIES.values()
                                 for unit in quantity.units}
                                | {"mbits", "tbps", "%%", "s%", "bps", "kbps", "mbps", "gbps"}))
_TEXTS = st.builds("".join, st.tuples(
    st.sampled_from(["", " "]), _NUMBERS, st.sampled_from(["", " "]),
    st.one_of(_UNITS, _UNITS.map(str.upper), _UNITS.map(str.title)), st.sampled_from(["", " "])))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_TEXTS)
def test_each_unit_pattern_takes_what_its_parser_takes(text: str):
    for kind, unit_required, positive in CASES:
        if kind == "fraction" and "e" in text.lower():
            continue  # a fraction's range with an exponent is beyond a regular expression
        regex = pattern(kind, unit_required=unit_required, positive=positive)
        matched = re.search(regex, text) is not None
        assert matched == _parses(kind, text, unit_required, positive), (kind, text)
