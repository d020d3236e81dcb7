"""The collective registry against the implementations it names: every scenario option is a
constructor option with the same default, capabilities match what the classes do, and the
commands that only read scenarios (`testbed scenario check`, `testbed compose`) load no torch."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testbed import collectives
from testbed.collectives import registry
from testbed.collectives.base import CollectiveBase


@pytest.mark.parametrize("kind", registry.kinds())
def test_every_scenario_option_is_a_constructor_option_with_the_same_default(kind):
    parameters = inspect.signature(collectives.implementation(kind)).parameters
    for name, field in registry.kind(kind).options.model_fields.items():
        assert name in parameters, f"{kind}: the constructor takes no {name}"
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].default == field.default, (
            f"{kind}.{name}: the scenario's default {field.default!r}, the constructor's "
            f"{parameters[name].default!r}")


@pytest.mark.parametrize("kind", registry.kinds())
def test_capabilities_match_the_implementation(kind):
    cls = collectives.implementation(kind)
    capabilities = registry.kind(kind).capabilities
    assert issubclass(cls, CollectiveBase) and cls.name == kind
    assert callable(getattr(cls, "step", None)) == capabilities.sharded_step
    if capabilities.reliable_exchange:  # its own exchange, or TCP streams for the mesh one
        assert (cls.neighbour_exchange is not CollectiveBase.neighbour_exchange
                or isinstance(inspect.getattr_static(cls, "mesh"), property)), kind
    if capabilities.exact:
        assert not capabilities.takes_back  # an exact collective fixes its peers at the start


@pytest.mark.parametrize("kind", registry.kinds())
def test_a_kind_that_authenticates_is_handed_the_runs_key_and_no_other_is(kind):
    placement = registry.Placement(rank=0, world=2, hosts=["10.0.0.1", "10.0.0.2"],
                                   port=lambda name, rank: 29500, key=b"k" * 32)
    given = registry.kind(kind).place(placement)
    parameters = inspect.signature(collectives.implementation(kind)).parameters
    if registry.kind(kind).capabilities.authenticates:
        assert given["key"] == b"k" * 32
        assert parameters["key"].kind is inspect.Parameter.KEYWORD_ONLY
    else:
        assert "key" not in given
    assert "k" * 32 not in repr(placement)  # never printed


def test_unknown_kinds_are_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"collective\.kind: expected one of ring, gloo"):
        registry.kind("rign")
    with pytest.raises(ValueError, match=r"compressor\.kind: expected one of none, topk"):
        registry.compressor_kind("zip")


def test_a_compressor_needs_an_exchange_where_the_registry_says():
    ring, moshpit = registry.kind("ring").capabilities, registry.kind("moshpit").capabilities
    assert registry.compressor_kind("topk").exchange_needed(ring)
    assert not registry.compressor_kind("arc_topk").exchange_needed(ring)  # agrees by all-reduce
    assert registry.compressor_kind("arc_topk").exchange_needed(moshpit)
    assert not registry.compressor_kind("randk").exchange_needed(moshpit)


def test_arc_topk_takes_its_sketch_and_the_sparsifiers_parameters():
    arc = registry.compressor_kind("arc_topk")
    assert set(registry.compressor_kind("topk").parameters) < set(arc.parameters)
    assert {"sketch", "sketch_rank", "block", "seed"} <= set(arc.parameters)
    assert registry.ARC_SKETCHES[0] == "projection", "the paper's sketch is the default"


NO_TORCH = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name}: this command must not import torch")
            return None

    sys.meta_path.insert(0, Refuse())
    from testbed.cli import app
    app(sys.argv[1:])
""")


@pytest.mark.parametrize("command", [
    ["scenario", "check", "SCENARIO"],
    ["compose", "SCENARIO", "-o", "OUT"],
    ["scenario", "schema"],
])
def test_commands_that_read_scenarios_import_no_torch(tmp_path: Path, command):
    from testbed.scenario import scenario_files

    scenario = next(path for path in scenario_files() if path.stem == "quickstart")
    argv = [str(scenario) if word == "SCENARIO" else str(tmp_path / "out") if word == "OUT"
            else word for word in command]
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
