"""Scenario files: one YAML file describes a run (workers, topology, job, collective, faults,
metrics); `load_scenario` validates it into a `Scenario` or raises one `ScenarioError` listing
every bad field with its path, line and what is allowed (docs/scenarios.md)."""

from testbed.scenario.collective import COLLECTIVES
from testbed.scenario.links import CUT, LinkState, partition_pairs
from testbed.scenario.load import (
    Problem,
    ScenarioError,
    find_scenario,
    load_scenario,
    scenario_files,
)
from testbed.scenario.model import Scenario
from testbed.scenario.schema import json_schema
from testbed.scenario.sections import WorkerOverride, Workers
from testbed.scenario.timeline import ACTIONS, Event, RampLink, SetLink, StragglerBurst
from testbed.scenario.topology import Link, Selector, Topology, patch_profile, resolve_link

__all__ = [
    "ACTIONS",
    "COLLECTIVES",
    "CUT",
    "Event",
    "Link",
    "LinkState",
    "Problem",
    "RampLink",
    "Scenario",
    "ScenarioError",
    "Selector",
    "SetLink",
    "StragglerBurst",
    "Topology",
    "WorkerOverride",
    "Workers",
    "find_scenario",
    "json_schema",
    "load_scenario",
    "partition_pairs",
    "patch_profile",
    "resolve_link",
    "scenario_files",
]
