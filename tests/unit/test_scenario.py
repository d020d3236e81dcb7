"""Scenario files: defaults, one clear error per kind of mistake (path, line, what is allowed),
link resolution per directed pair, the links' seeds, the timeline's helpers, samples files, the
shipped scenarios, the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from netem.profile import LinkProfile, derive_seed
from testbed.cli import app
from testbed.scenario import (
    LinkState,
    Scenario,
    ScenarioError,
    find_scenario,
    json_schema,
    load_scenario,
    partition_pairs,
    patch_profile,
    resolve_link,
    scenario_files,
)
from testbed.scenario.links import draws_random, run_order
from testbed.scenario.load import SHIPPED
from testbed.scenario.topology import LinkPatch, Topology

QUICKSTART = """\
name: quickstart
workers: 4
topology: {default: {delay: 5ms, loss: 1%}}
job: {model: mlp, steps: 50}
collective: {kind: lossy}
"""
BASE = "name: x\nworkers: 4\n"
GROUPS = "topology: {groups: {east: [0, 1], west: [2, 3]}}\n"

SHIPPED_NAMES = {
    "quickstart", "loss-1", "loss-5", "loss-10", "loss-20", "jitter-wan", "bandwidth-100mbit",
    "two-regions", "stragglers", "preemption", "cross-traffic",
}


def problems(text: str) -> list[tuple[str, str, int | None]]:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(text)
    return [(p.path, p.message, p.line) for p in caught.value.problems]


# --- defaults -----------------------------------------------------------------------------------


def test_five_lines_make_a_complete_scenario():
    scenario = load_scenario(QUICKSTART)
    assert scenario.name == "quickstart" and scenario.seed == 0 and scenario.count == 4
    assert scenario.workers.overrides == []
    topology = scenario.topology
    assert topology.default == LinkProfile.parse(delay="5ms", loss="1%")
    assert (topology.mtu, topology.congestion, topology.groups, topology.links) == (
        1500, "cubic", {}, [])
    assert scenario.job.steps == 50 and scenario.job.batch == 32
    assert scenario.job.optimizer.sgd.lr == 0.1
    assert scenario.collective.kind == "lossy" and scenario.collective.options() == {}
    assert scenario.timeline == []
    assert scenario.metrics.port == 9100 and scenario.metrics.drift_every == 10
    links = scenario.links()
    assert len(links) == 12 and set(links.values()) == {topology.default}
    assert scenario.congestion(3) == "cubic" and scenario.straggler(3) is None
    config = scenario.train_config(2)
    assert (config.model, config.steps, config.seed, config.straggler) == ("mlp", 50, 0, None)


def test_an_empty_mapping_is_a_scenario_too():
    scenario = load_scenario("{}\n")
    assert scenario.count == 4 and scenario.collective.kind == "ring"
    assert scenario.topology.default.is_perfect


def test_a_file_without_name_is_named_after_it(tmp_path: Path):
    path = tmp_path / "my-run.yaml"
    path.write_text("workers: 2\n")
    assert load_scenario(path).name == "my-run"
    assert load_scenario(str(path)).name == "my-run"


# --- errors: path, message, line ----------------------------------------------------------------


INVALID = {
    "unknown top-level key": (
        BASE + "wrokers: 3\n", "wrokers", "unknown field (did you mean 'workers'?); allowed: name",
        3),
    "typo in a nested key": (
        BASE + "topology:\n  default: {delay: 5ms}\n  congestoin: bbr\n", "topology.congestoin",
        "did you mean 'congestion'?", 5),
    "bad unit in loss": (
        BASE + "topology:\n  links:\n    - {from: 0, to: 1, profile: {loss: 1%}}\n"
        "    - {from: 1, to: 2, profile: {loss: 1%}}\n"
        "    - {from: 2, to: 3, profile: {loss: 5 pct}}\n",
        "topology.links[2].profile.loss", "expected a percentage such as '5%'", 7),
    "loss above 100%": (
        BASE + "topology: {default: {loss: 120%}}\n", "topology.default.loss",
        "a fraction between 0 and 1, got '120%'", 3),
    "negative delay": (
        BASE + "topology: {default: {delay: -5ms}}\n", "topology.default.delay",
        "(not negative), got '-5ms'", 3),
    "jitter without delay": (
        BASE + "topology: {default: {jitter: 5ms}}\n", "topology.default",
        "jitter needs a delay", 3),
    "unknown collective kind": (
        BASE + "collective: {kind: allgather}\n", "collective.kind",
        "unknown collective 'allgather'; allowed: ring, gloo, moshpit, lossy", 3),
    "unknown collective option": (
        BASE + "collective:\n  kind: lossy\n  deadline: 3\n", "collective.deadline",
        "unknown field (did you mean 'deadline_floor'?); allowed: kind, rate", 5),
    "placement option in a scenario": (
        BASE + "collective: {kind: ring, addresses: []}\n", "collective.addresses",
        "allowed: kind, timeout", 3),
    "bad collective option value": (
        BASE + "collective: {kind: moshpit, group_size: big}\n", "collective.group_size",
        "valid integer", 3),
    "worker out of range in a kill": (
        BASE + "timeline:\n  - {at: 10s, kill: 7}\n", "timeline[0].kill[0]",
        "no worker 7: workers are 0..3", 4),
    "worker out of range in a burst": (
        BASE + "timeline:\n  - step: 3\n    straggler_burst:\n      workers: [1, 4]\n"
        "      delay: {fixed: 50ms}\n      steps: 2\n",
        "timeline[0].straggler_burst.workers[1]", "no worker 4", 6),
    "unknown group in a partition": (
        BASE + GROUPS + "timeline:\n  - {step: 3, partition: [east, north]}\n",
        "timeline[0].partition[1]", "unknown group 'north'; allowed: east, west", 5),
    "unknown group in a link": (
        BASE + GROUPS.replace("}}\n", "}, links: [{between: [east, south], profile: {}}]}\n"),
        "topology.links[0].between[1]", "unknown group 'south'; allowed: east, west", 3),
    "ramp over zero seconds": (
        BASE + "timeline:\n  - {at: 1s, ramp_link: {to: {loss: 20%}, over: 0s}}\n",
        "timeline[0].ramp_link.over", "greater than 0", 4),
    "ramp of a field that cannot move": (
        BASE + "timeline:\n  - {at: 1s, ramp_link: {to: {limit: 10}, over: 5s}}\n",
        "timeline[0].ramp_link", "cannot ramp limit", 4),
    "both at and step": (
        BASE + "timeline:\n  - {at: 1s, step: 3, kill: 1}\n", "timeline[0]",
        "give exactly one of at (seconds, e.g. 30s) or step", 4),
    "neither at nor step": (
        BASE + "timeline:\n  - {kill: 1}\n", "timeline[0]", "give exactly one of at", 4),
    "two actions in one event": (
        BASE + "timeline:\n  - {at: 1s, kill: 1, restart: 1}\n", "timeline[0]",
        "got kill, restart", 4),
    "negative time": (
        BASE + "timeline:\n  - {at: -1s, kill: 1}\n", "timeline[0].at", "(not negative)", 4),
    "step never reached": (
        BASE + "job: {steps: 10}\ntimeline:\n  - {step: 10, kill: 1}\n", "timeline[0].step",
        "step 10 is never reached: the job has steps 0..9", 5),
    "restart before any kill": (
        BASE + "timeline:\n  - {at: 5s, restart: 1}\n  - {at: 9s, kill: 1}\n",
        "timeline[0].restart", "worker 1 is restarted before any kill", 4),
    "restart with a collective that cannot take a worker back": (
        BASE + "timeline:\n  - {at: 5s, kill: 1}\n  - {at: 9s, restart: 1}\n",
        "timeline[1].restart", "collective ring cannot take a worker back", 5),
    "restart with lossy's resync": (
        BASE + "collective: {kind: lossy, resync_every: 10}\n"
        "timeline:\n  - {at: 5s, kill: 1}\n  - {at: 9s, restart: 1}\n",
        "timeline[1].restart", "set collective.resync_every to 0", 6),
    "wrong type for workers": (
        "name: x\nworkers: four\n", "workers",
        "expected a number of workers or a mapping {count, overrides}, got 'four'", 2),
    "congestion not cubic or bbr": (
        BASE + "topology: {congestion: reno}\n", "topology.congestion",
        "expected 'cubic' or 'bbr', got 'reno'", 3),
    "duplicate worker override": (
        "workers:\n  count: 4\n  overrides:\n    - {worker: 1, slowdown: 2}\n"
        "    - {worker: [2, 1], slowdown: 3}\n",
        "workers.overrides[1].worker", "worker 1 is already overridden in overrides[0]", 5),
    "override that overrides nothing": (
        "workers: {count: 2, overrides: [{worker: 1}]}\n", "workers.overrides[0]",
        "give at least one of straggler, slowdown, congestion", 1),
    "worker in two groups": (
        BASE + "topology: {groups: {a: [0, 1], b: [1, 2]}}\n", "topology.groups.b",
        "worker 1 is already in group 'a'", 3),
    "two links with the same precedence": (
        BASE + "topology:\n  links:\n    - {from: 0, to: 1, profile: {loss: 1%}}\n"
        "    - {between: [1, 0], profile: {loss: 2%}}\n",
        "topology.links[1]", "like links[0], with the same precedence", 6),
    "half a selector": (
        BASE + "topology:\n  links:\n    - {from: 0, profile: {loss: 1%}}\n",
        "topology.links[0]", "give both from and to", 5),
    "patch that breaks the link": (
        BASE + "timeline:\n  - {at: 1s, set_link: {profile: {jitter: 5ms}}}\n",
        "timeline[0].set_link.profile", "on link 0->1: link profile: jitter needs a delay", 4),
    "seed in the job": (
        BASE + "job: {seed: 3}\n", "job.seed", "set seed at the top level", 3),
    "job field validated by TrainConfig": (
        BASE + "job: {model: gpt}\n", "job.model", "expected 'mlp', 'cnn' or 'char-lm'", 3),
    "char-lm's size under another model": (
        BASE + "job: {model: cnn, width: 128}\n", "job",
        "width and layers apply to model: char-lm only", 3),
    "an ARC-Top-K sketch that does not exist": (
        BASE + "collective: {kind: ring, compressor: {kind: arc_topk, sketch: rows}}\n",
        "collective.compressor.sketch", "expected 'projection' or 'marginal', got 'rows'", 3),
    "EF21M's options with EF14": (
        BASE + "collective: {kind: ring, compressor: {kind: topk, feedback: ef14, "
        "momentum: 0.5}}\n", "collective.compressor", "momentum and resync_every are EF21M's",
        3),
    "straggler validated by StragglerSpec": (
        "workers:\n  count: 2\n  overrides:\n    - worker: 1\n"
        "      straggler: {lognormal: {median: 0s, sigma: 1}}\n",
        "workers.overrides[0].straggler.lognormal.median", "greater than 0", 5),
    "sharded with a collective that cannot": (
        BASE + "job: {strategy: sharded}\ncollective: {kind: ring}\n", "job.strategy",
        "sharded needs a collective that owns the update (step()): lossy; got ring", 3),
    "a stand-in for parameters without the sharded step": (
        BASE + "job: {strategy: gradient}\ncollective: {kind: lossy, missed: last_update}\n",
        "collective.missed", "last_update fills in the parameters the owners broadcast, which "
        "only strategy sharded has; with strategy gradient use keep", 4),
    "settle neither seconds nor auto": (
        BASE + "collective: {kind: lossy, settle: soon}\n", "collective.settle", "auto", 3),
    "mtu out of range": (
        BASE + "topology: {mtu: 100000}\n", "topology.mtu", "less than or equal to 9000", 3),
    "a link change that breaks the link in the order the run takes": (
        BASE + "topology: {default: {delay: 10ms}}\ntimeline:\n"
        "  - {at: 20s, set_link: {profile: {jitter: 2ms}}}\n"
        "  - {at: 10s, set_link: {profile: {delay: null}}}\n",
        "timeline[0].set_link.profile", "jitter needs a delay: netem varies the delay around its "
        "mean (events run in time and step order: this one runs after timeline[1], listed "
        "after it)", 5),
    "a restart run before its kill": (
        BASE + "collective: {kind: moshpit}\njob: {strategy: average}\ntimeline:\n"
        "  - {at: 9s, kill: 1}\n  - {at: 5s, restart: 1}\n", "timeline[1].restart",
        "restarted before any kill (events run in time and step order: this one runs before "
        "timeline[0], listed before it)", 7),
    "a delay beyond the kernel's s64 nanoseconds": (
        BASE + "topology: {default: {delay: 100000000000000s}}\n", "topology.default.delay",
        "expected at most 9223372036s (netem keeps a time as signed 64-bit nanoseconds)", 3),
    "a rate beyond the kernel's u64 bytes per second": (
        BASE + "topology: {default: {rate: 1000000000000gbit}}\n", "topology.default.rate",
        "expected at most 147573952tbit", 3),
    "a loss too small for netem to keep": (
        BASE + "topology: {default: {loss: 0.00000001%}}\n", "topology.default.loss",
        "expected 0 or at least 0.0000001% (less would be 0 to netem)", 3),
    "a rate in mbps": (
        BASE + "topology: {default: {rate: 100mbps}}\n", "topology.default.rate",
        "ambiguous: tc reads mbps as megabytes per second ('800mbit'), most tools as megabits "
        "per second ('100mbit')", 3),
    "a misspelt action": (
        BASE + "timeline:\n  - {at: 1s, kill: 1}\n  - {at: 2s, partion: [a]}\n",
        "timeline[1].partion", "unknown field (did you mean 'partition'?); allowed: at, step, "
        "note, set_link, ramp_link, partition, heal, kill, restart, straggler_burst", 5),
    "an unknown field of a ramp": (
        BASE + "timeline:\n  - {at: 1s, ramp_link: {to: {loss: 5%}, over: 5s, during: 3s}}\n",
        "timeline[0].ramp_link.during", "unknown field; allowed: link, from, to, over, every", 4),
    "a profile's field beside a link's profile": (
        BASE + "topology:\n  links:\n    - {from: 0, to: 1, delay: 5ms}\n",
        "topology.links[0].delay", "unknown field (a field of profile: write profile: {delay: "
        "...}); allowed: from, to, between, profile", 5),
    "a patch's field beside the patch": (
        BASE + "timeline:\n  - {at: 1s, set_link: {loss: 5%}}\n", "timeline[0].set_link.loss",
        "a field of profile: write profile: {loss: ...}", 4),
    "a compressor's parameter beside the collective's options": (
        BASE + "collective: {kind: lossy, density: 0.1}\n", "collective.density",
        "a field of compressor: write compressor: {density: ...}", 3),
    "a collective named by its kind alone": (
        BASE + "collective: moshpit\n", "collective",
        "expected a mapping: write collective: {kind: moshpit}", 3),
    "a command as one string": (
        BASE + "job: {command: python train.py --steps 3}\n", "job.command",
        'expected a list of the program and its arguments (no shell splits a string here), '
        'e.g. command: ["python", "train.py", "--steps", "3"]', 3),
    "a number where a command's word goes": (
        BASE + "job: {command: [python, train.py, --steps, 30]}\n", "job.command[3]",
        "expected text, got the number 30: quote it ('30')", 3),
    "workers where a partition takes groups": (
        BASE + GROUPS + "timeline:\n  - {at: 1s, partition: [0, 1]}\n",
        "timeline[0].partition[0]", "expected a group's name, got the number 0", 5),
    "a name its pattern refuses": (
        "name: my run!\n", "name", "expected letters, digits, '.', '_' and '-', starting with a "
        "letter or a digit (no spaces), got 'my run!'", 1),
    "a section given as a number": (
        BASE + "topology: 5\n", "topology",
        "expected a mapping of default, groups, links, mtu, congestion, got 5", 3),
    "a collective time with a unit it cannot read": (
        BASE + "collective: {kind: ring, timeout: 2 fortnights}\n", "collective.timeout",
        "expected a duration such as '10ms'", 3),
    "duplicate key": (
        BASE + "seed: 1\nseed: 2\n", "seed", "duplicate key (first on line 3)", 4),
    "YAML syntax error": (
        BASE + "topology: {default: {delay: 5ms}\njob: {steps: 3}\n", "",
        "YAML syntax: expected ',' or '}'", 4),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_each_mistake_is_named_with_its_path_line_and_what_is_allowed(case: str):
    text, path, fragment, line = INVALID[case]
    found = problems(text)
    assert any(p == path and fragment in m and n == line for p, m, n in found), found


# YAML reads true/false (and yes/no/on/off) as booleans, which Python would count as 1 and 0:
# every number of every part of a scenario refuses them, as its JSON Schema does.
BOOLEAN_NUMBERS = {
    "the run's seed": ("seed: yes\n", "seed", "expected an integer, got true"),
    "a job's steps": ("job: {steps: true}\n", "job.steps", "expected an integer, got true"),
    "an optimizer's rate": ("job: {optimizer: {sgd: {lr: true}}}\n", "job.optimizer.sgd.lr",
                            "expected a number, got true"),
    "a straggler's parameter": ("job: {straggler: {lognormal: {median: 10ms, sigma: true}}}\n",
                                "job.straggler.lognormal.sigma", "expected a number, got true"),
    "a metrics port": ("metrics: {port: false}\n", "metrics.port",
                       "expected an integer, got false"),
    "a collective's option": ("collective: {kind: lossy, parity: true}\n", "collective.parity",
                              "expected 0 (none) or the chunks per parity chunk, got True"),
    "a compressor's option": ("collective: {kind: lossy, compressor: {kind: topk, density: on}}\n",
                              "collective.compressor.density", "expected a number, got true"),
    "a worker's slowdown": ("workers: {count: 4, overrides: [{worker: 1, slowdown: true}]}\n",
                            "workers.overrides[0].slowdown", "expected a number, got true"),
    "a link's gap": ("topology: {default: {gap: false}}\n", "topology.default.gap",
                     "expected an integer, got false"),
    "a link's seed": ("topology: {default: {loss: 1%, seed: true}}\n", "topology.default.seed",
                      "expected an integer, got true"),
}


@pytest.mark.parametrize("case", BOOLEAN_NUMBERS, ids=list(BOOLEAN_NUMBERS))
def test_no_boolean_is_taken_for_a_number(case: str):
    text, path, message = BOOLEAN_NUMBERS[case]
    found = problems("name: x\n" + text)
    assert any(p == path and message in m and n == 2 for p, m, n in found), found


def test_yaml_syntax_error_has_line_and_column():
    with pytest.raises(ScenarioError) as caught:
        load_scenario("name: x\nworkers: [1, 2\n")
    problem = caught.value.problems[0]
    assert problem.line is not None and problem.column is not None
    assert f"<text>:{problem.line}:{problem.column}: YAML syntax" in str(caught.value)


def test_every_bad_field_is_listed_in_one_error_with_the_file_name(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("workers: 4\nseed: -1\ntopology: {default: {loss: 5 pct}}\n"
                    "job: {steps: 0, stepz: 3}\n")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    paths = {p.path for p in caught.value.problems}
    assert paths == {"seed", "topology.default.loss", "job.steps", "job.stepz"}
    text = str(caught.value)
    assert text.startswith(f"invalid scenario {path}:")
    assert f"{path}:2: seed: Input should be greater than or equal to 0, got -1" in text
    assert f"{path}:4: job.stepz: unknown field (did you mean 'steps'?)" in text


def test_empty_file_and_non_mapping_are_errors():
    assert "empty file" in problems("")[0][1]
    assert "expected a mapping of sections, got list" in problems("- 1\n")[0][1]


def test_missing_file_is_a_scenario_error(tmp_path: Path):
    with pytest.raises(ScenarioError, match="No such file"):
        load_scenario(tmp_path / "nope.yaml")


# --- links --------------------------------------------------------------------------------------


def topology(**spec) -> Topology:
    return Topology.model_validate(spec)


def test_resolve_link_default_group_and_worker_precedence():
    wan = {"delay": "40ms", "loss": "2%"}
    topo = topology(
        default={"delay": "1ms"},
        groups={"east": [0, 1], "west": [2, 3]},
        links=[
            {"between": ["east", "west"], "profile": wan},
            {"from": 0, "to": "west", "profile": {"delay": "60ms"}},  # one direction only
            {"from": 1, "to": 3, "profile": {"loss": "50%"}},  # most specific
        ],
    )
    assert resolve_link(topo, 0, 1) == LinkProfile.parse(delay="1ms")  # inside east
    assert resolve_link(topo, 1, 2) == LinkProfile.parse(wan)
    assert resolve_link(topo, 2, 1) == LinkProfile.parse(wan)  # between: both directions
    assert resolve_link(topo, 0, 2) == LinkProfile.parse(delay="60ms")  # worker->group wins
    assert resolve_link(topo, 2, 0) == LinkProfile.parse(wan)  # ...but only that direction
    assert resolve_link(topo, 1, 3) == LinkProfile.parse(loss="50%")  # worker->worker wins
    assert resolve_link(topo, 3, 1) == LinkProfile.parse(wan)
    # The order of the links does not matter.
    shuffled = topology(**{**topo.model_dump(by_alias=True), "links": [
        link.model_dump(by_alias=True) for link in reversed(topo.links)]})
    assert all(resolve_link(shuffled, s, d) == resolve_link(topo, s, d)
               for s in range(4) for d in range(4) if s != d)


def test_scenario_links_table_covers_every_directed_pair():
    scenario = load_scenario(SHIPPED / "two-regions.yaml")
    links = scenario.links()
    assert len(links) == 8 * 7
    assert links[(0, 4)].delay == 0.04 and links[(4, 0)].delay == 0.04
    assert links[(0, 3)].delay == 0.001 and links[(5, 6)].rate == 1_000_000_000


def test_selector_pairs_and_partition_pairs():
    groups = {"east": [0, 1], "west": [2, 3]}
    topo = topology(groups=groups, links=[{"from": "east", "to": 3, "profile": {}}])
    assert topo.links[0].pairs(groups, 4) == [(0, 3), (1, 3)]
    assert partition_pairs(groups, ["east", "west"], 4) == {
        (s, d) for s in range(4) for d in range(4) if (s < 2) != (d < 2)}
    alone = partition_pairs({"a": [2]}, ["a"], 4)
    assert alone == {(2, 0), (2, 1), (2, 3), (0, 2), (1, 2), (3, 2)}


def test_patch_keeps_other_fields_and_null_resets():
    current = LinkProfile.parse(delay="40ms", jitter="8ms", loss="2%", rate="100mbit")
    patched = patch_profile(current, LinkPatch.model_validate({"loss": "10%", "rate": None}))
    assert patched == LinkProfile.parse(delay="40ms", jitter="8ms", loss="10%")


def test_ramp_moves_linearly_and_stops_at_its_target():
    scenario = load_scenario(BASE + "topology: {default: {delay: 10ms}}\ntimeline:\n"
                             "  - {at: 0s, ramp_link: {from: {loss: 0%, rate: 10mbit}, "
                             "to: {loss: 20%, rate: 30mbit}, over: 60s}}\n")
    ramp = scenario.timeline[0].ramp_link
    start = scenario.link_profile(0, 1)
    assert ramp.profile_at(start, 0) == LinkProfile.parse(delay="10ms", rate="10mbit")
    middle = ramp.profile_at(start, 30)
    assert middle == LinkProfile.parse(delay="10ms", loss="10%", rate="20mbit")
    assert ramp.profile_at(start, 600) == LinkProfile.parse(delay="10ms", loss="20%",
                                                            rate="30mbit")


def test_rate_ramp_needs_a_start():
    found = problems(BASE + "timeline:\n  - {at: 0s, ramp_link: {to: {rate: 1mbit}, over: 5s}}\n")
    assert found[0][0] == "timeline[0].ramp_link" and "needs from.rate" in found[0][1]


# --- seeds --------------------------------------------------------------------------------------


SEEDED = BASE + """seed: 5
topology:
  default: {loss: 1%}
  links:
    - {from: 0, to: 1, profile: {loss: 2%, seed: 99}}
    - {from: 0, to: 2, profile: {delay: 10ms, rate: 10mbit}}
"""


def test_each_link_gets_its_own_seed_from_the_runs_and_its_profiles_wins():
    scenario = load_scenario(SEEDED)
    links = LinkState.of(scenario)
    assert links.shaped(1, 0) == LinkProfile.parse(loss="1%", seed=derive_seed(5, 1, 0))
    assert links.shaped(0, 3).seed == derive_seed(5, 0, 3) != links.shaped(3, 0).seed
    assert links.shaped(0, 1).seed == 99  # the profile's own
    assert links.shaped(0, 2).seed is None  # draws no random numbers: needs none
    assert links.current(1, 0) == scenario.link_profile(1, 0) == LinkProfile.parse(loss="1%")
    assert len(links.seeds()) == 11 and links.seeds()["0->1"] == 99 and "0->2" not in links.seeds()
    # Another link's change, or another link in the file, leaves a link's seed as it was.
    other = load_scenario(SEEDED.replace("loss: 2%", "loss: 30%") + "    - {from: 3, to: 2, "
                          "profile: {duplicate: 1%}}\n")
    assert LinkState.of(other).shaped(1, 0) == links.shaped(1, 0)
    assert LinkState.of(load_scenario(SEEDED.replace("seed: 5", "seed: 6"))).shaped(1, 0).seed \
        == derive_seed(6, 1, 0)
    assert LinkState(scenario.links(), {}, 4).shaped(1, 0).seed is None  # no run seed


@pytest.mark.parametrize("profile", [
    {"loss": "1%"}, {"gilbert_elliott": {"p": "1%"}}, {"duplicate": "1%"}, {"corrupt": "1%"},
    {"delay": "5ms", "reorder": "1%"}, {"delay": "5ms", "jitter": "1ms"},
    {"slot": {"distribution": "normal", "delay": "2ms", "jitter": "1ms"}},
])
def test_what_draws_random_numbers_needs_a_seed(profile):
    assert draws_random(LinkProfile.parse(profile))
    assert not draws_random(LinkProfile.parse(delay="5ms", rate="1mbit", limit=10,
                                              slot={"min_delay": "1ms"}))


def test_a_samples_file_is_relative_to_the_scenario_file(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "rtt.txt").write_text("\n".join(str(10 + k % 7) for k in range(100)))
    path = tmp_path / "s.yaml"
    path.write_text(BASE + "topology: {default: {distribution: {samples: rtt.txt, unit: ms}}}\n"
                    "timeline:\n  - {at: 1s, set_link: {profile: {slot: {distribution: "
                    "{samples: rtt.txt, unit: ms}}}}}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    scenario = load_scenario(path)
    assert scenario.link_profile(0, 1).distribution.samples == str(tmp_path / "rtt.txt")
    change = scenario.timeline[0].set_link.profile
    assert change.slot.distribution.samples == str(tmp_path / "rtt.txt")
    copy = tmp_path / "run" / "scenario.yaml"  # a run directory's copy: relative to base_dir
    copy.parent.mkdir()
    copy.write_text(path.read_text())
    assert load_scenario(copy, base_dir=tmp_path).link_profile(0, 1) == (
        scenario.link_profile(0, 1))
    with pytest.raises(ScenarioError, match=r"rtt\.txt"):
        load_scenario(copy)  # relative to the copy's own directory, where there is none


# --- workers, job, steps ------------------------------------------------------------------------


def test_worker_overrides_reach_train_config_and_congestion():
    scenario = load_scenario(SHIPPED / "stragglers.yaml")
    assert scenario.train_config(3).straggler.lognormal.median == 0.02
    assert scenario.train_config(0).straggler.exponential.mean == 0.002  # the job's, for all
    assert scenario.train_config(0).seed == scenario.seed == 4
    assert scenario.train_config(0).drop_compute.threshold == "auto"
    assert scenario.slowdown(2) == 3 and scenario.slowdown(0) == 1
    mixed = load_scenario("workers: {count: 3, overrides: [{worker: [1, 2], congestion: bbr}]}\n")
    assert [mixed.congestion(w) for w in range(3)] == ["cubic", "bbr", "bbr"]


def test_with_steps_shortens_the_job_and_moves_step_events():
    scenario = load_scenario(SHIPPED / "preemption.yaml")
    short = scenario.with_steps(30)
    assert short.job.steps == 30 and scenario.job.steps == 300
    assert [e.clock for e in short.timeline] == [("at", 30.0), ("at", 60.0), ("step", 15),
                                                  ("step", 22)]
    assert load_scenario(SHIPPED / "preemption.yaml", steps=30) == short
    assert short.with_steps(1).timeline[2].step == 0
    with pytest.raises(ValueError, match="steps"):
        scenario.with_steps(0)


def test_events_describe_themselves_for_the_event_log():
    scenario = load_scenario(SHIPPED / "two-regions.yaml")
    assert [event.describe() for event in scenario.timeline] == [
        "at 60s: ramp_link east<->west loss=2% -> loss=10% over 30s",
        "at 120s: partition east, west",
        "at 150s: heal all",
        "at 180s: set_link east<->west loss=2%",
    ]
    assert [event.action for event in scenario.timeline] == [
        "ramp_link", "partition", "heal", "set_link"]


def test_collective_options_are_the_constructors():
    scenario = load_scenario(SHIPPED / "preemption.yaml")
    assert scenario.collective.options() == {"group_size": 4, "timeout": 2.0, "heartbeat": 0.5}


@pytest.mark.parametrize(("text", "namespaces", "compose"), [
    ("collective: {kind: lossy}", False, True),  # auto: on where the network is shared
    ("collective: {kind: ring}\nsecurity: {authenticate: true}", True, True),
    ("collective: {kind: moshpit}\nsecurity: {authenticate: false}", False, False),
    ("collective: {kind: gloo}", False, False),  # auto: gloo cannot prove a key
    ("job: {command: [python, train.py]}", False, False),  # nor a command of the user's own
])
def test_authenticate_auto_is_on_under_compose_where_the_collective_can(text, namespaces,
                                                                         compose):
    scenario = load_scenario(text + "\n")
    assert scenario.authenticates("namespaces") is namespaces
    assert scenario.authenticates("compose") is compose


@pytest.mark.parametrize(("text", "message"), [
    ("collective: {kind: gloo}", "collective gloo cannot prove the run's key on its sockets"),
    ("job: {command: [python, train.py]}", "a command job's sockets are its own program's"),
])
def test_authenticate_true_needs_sockets_the_testbed_can_authenticate(text, message):
    with pytest.raises(ScenarioError) as caught:
        load_scenario(f"{text}\nsecurity: {{authenticate: true}}\n")
    (problem,) = caught.value.problems
    assert problem.path == "security.authenticate" and message in problem.message


# --- shipped scenarios, schema, CLI -------------------------------------------------------------


def test_every_shipped_scenario_loads_and_says_what_it_shows():
    files = scenario_files()
    assert {path.stem for path in files} == SHIPPED_NAMES
    for path in files:
        scenario = load_scenario(path)
        assert scenario.name == path.stem
        lines = path.read_text().splitlines()
        assert lines[0] == "# yaml-language-server: $schema=scenario.schema.json"
        assert lines[1].startswith(f"# {path.stem}: ")
        assert scenario.with_steps(5).job.steps == 5


def test_committed_schema_is_the_generated_one():
    committed = json.loads((SHIPPED / "scenario.schema.json").read_text())
    assert committed == json_schema(), (
        "stale: run `testbed scenario schema -o compose/scenarios/scenario.schema.json`")


def test_schema_accepts_human_units_and_single_items():
    defs = json_schema()["$defs"]
    delay = defs["LinkProfile"]["properties"]["delay"]["anyOf"]
    assert {"const": 0} in delay  # a bare number is refused, but for 0
    assert any(branch.get("type") == "string" for branch in delay)
    kill = defs["Event"]["properties"]["kill"]["anyOf"]
    assert {"minimum": 0, "type": "integer"} in kill
    assert json_schema()["properties"]["collective"]["discriminator"]["propertyName"] == "kind"
    assert Scenario.model_config["extra"] == "forbid"


EXAMPLES = sorted((Path(__file__).parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", [*scenario_files(), *EXAMPLES], ids=lambda p: p.name)
def test_every_shipped_and_example_scenario_is_valid_under_the_schema(path: Path):
    jsonschema.validate(yaml.safe_load(path.read_text()), json_schema())


# Hand-written bad cases: the loader and the schema refuse each (the loader naming the field).
BAD = [
    ("topology: {default: {loss: -1%}}", "topology.default.loss"),
    ("topology: {default: {loss: 150%}}", "topology.default.loss"),
    ("topology: {default: {loss: 1.5}}", "topology.default.loss"),
    ("topology: {default: {loss: '2'}}", "topology.default.loss"),
    ("topology: {default: {delay: 5}}", "topology.default.delay"),
    ("topology: {default: {delay: '5'}}", "topology.default.delay"),
    ("topology: {default: {delay: -5ms}}", "topology.default.delay"),
    ("topology: {default: {delay: 5 parsecs}}", "topology.default.delay"),
    ("topology: {default: {rate: 100}}", "topology.default.rate"),
    ("topology: {default: {rate: 100 mbits}}", "topology.default.rate"),
    ("topology: {default: {duplicate: 10 %%}}", "topology.default.duplicate"),
    ("topology: {congestion: reno}", "topology.congestion"),
    ("workers: 0", "workers.count"),
    ("collective: {kind: rign}", "collective.kind"),
    ("timeline: [{at: -1s, kill: 1}]", "timeline[0].at"),
    ("timeline: [{at: 1s, set_link: {profile: {jitter: 3}}}]",
     "timeline[0].set_link.profile.jitter"),
    ("security: {authenticate: maybe}", "security.authenticate"),
    ("security: {authenticate: 1}", "security.authenticate"),
    ("collective: {kind: ring, compressor: {kind: arc_topk, sketch: rows}}",
     "collective.compressor.sketch"),
    ("job: {seed: 3}", "job.seed"),
    ("topology: {default: {rate: 100mbps}}", "topology.default.rate"),
    ("collective: {kind: lossy, rate: 10mbps}", "collective.rate"),
    ("collective: {kind: ring, timeout: 0s}", "collective.timeout"),
    ("collective: {kind: lossy, settle: -5ms}", "collective.settle"),
    ("collective: moshpit", "collective"),
    ("job: {command: python train.py}", "job.command"),
    ("name: my run", "name"),
]
GOOD = ["topology: {default: {delay: 0, loss: 5%, rate: 100mbit}}",
        "topology: {default: {delay: 1.5ms, jitter: 200us, loss: 0.05}}",
        "topology: {default: {delay: '0ms', loss: 100%, rate: 1.5gbit}}",
        "security: {authenticate: auto}", "security: {authenticate: false}",
        "collective: {kind: ring, compressor: {kind: arc_topk, sketch: marginal, "
        "sketch_rank: 2, seed: 3}}",
        "job: {model: char-lm, width: 160, layers: 4}",
        "collective: {kind: ring, timeout: 2s, rendezvous_timeout: 2}",
        "collective: {kind: lossy, rate: 100mbit, settle: 5ms, deadline_floor: 10ms}",
        "collective: {kind: lossy, settle: auto, rate: 2e8}",
        "collective: {kind: moshpit, heartbeat: 500ms, expiry: null}"]


@pytest.mark.parametrize(("text", "field"), BAD, ids=[field for _, field in BAD])
def test_the_loader_and_the_schema_refuse_the_same_bad_input(text: str, field: str):
    with pytest.raises(ScenarioError) as caught:
        load_scenario(text + "\n")
    assert any(problem.path == field for problem in caught.value.problems), caught.value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(text), json_schema())


@pytest.mark.parametrize("text", GOOD)
def test_the_loader_and_the_schema_take_the_same_good_input(text: str):
    load_scenario(text + "\n")
    jsonschema.validate(yaml.safe_load(text), json_schema())


def test_cli_check_and_schema(tmp_path: Path):
    good = SHIPPED / "quickstart.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: 4\ntopology: {congestion: reno}\n")
    runner = CliRunner()
    result = runner.invoke(app, ["scenario", "check", str(good)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"ok {good}: quickstart: 4 workers")
    result = runner.invoke(app, ["scenario", "check", str(good), str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: topology.congestion: expected 'cubic' or 'bbr', got 'reno'" in (
        result.output)
    assert "1 of 2 scenario file(s) invalid" in result.output
    out = tmp_path / "schema.json"
    result = runner.invoke(app, ["scenario", "schema", "-o", str(out)])
    assert result.exit_code == 0 and json.loads(out.read_text()) == json_schema()
    printed = runner.invoke(app, ["scenario", "schema"])
    assert json.loads(printed.output) == json_schema()


# --- capture ----------------------------------------------------------------------------------

CAPTURE_BASE = "name: c\nworkers: 3\ntopology: {groups: {east: [0], west: [1, 2]}}\n"


def test_the_capture_section_selects_links_like_the_topology():
    scenario = load_scenario(CAPTURE_BASE + 'capture: {links: ["0->1", "east<->west", '
                             '{from: 2, to: 0}], max_bytes: 1MiB, snap: 96}\n')
    assert scenario.capture_pairs() == [(0, 1), (0, 2), (1, 0), (2, 0)]
    assert (scenario.capture.max_bytes, scenario.capture.snap) == (2**20, 96)
    assert "capture 0->1, east<->west, 2->0 (1MiB per file, snap 96)" in scenario.summary()
    assert load_scenario(CAPTURE_BASE + "capture: {links: [all]}\n").capture_pairs() == [
        (s, d) for s in range(3) for d in range(3) if s != d]
    assert load_scenario(CAPTURE_BASE).capture_pairs() == []
    assert load_scenario(CAPTURE_BASE).with_capture(["2->1"]).capture_pairs() == [(2, 1)]


@pytest.mark.parametrize(("section", "problem"), [
    ('{links: ["0->7"]}', "capture.links[0].to: no worker 7: workers are 0..2"),
    ('{links: ["0-1"]}', "capture.links[0]: expected a link such as '0->1'"),
    ('{links: ["north->east"]}', "capture.links[0].from: unknown group 'north'; allowed: east, "
                                 "west"),
    ("{links: [{from: 1, to: 1}]}", "capture.links[0]: 1->1 selects no link"),
    ("{max_bytes: 10}", "capture.max_bytes: 10 has no unit: write '10MB'"),
    ("{max_bytes: 10B}", "capture.max_bytes: Input should be greater than or equal to 1000"),
    ("{max_bytes: lots}", "capture.max_bytes: expected a size such as '20MB'"),
    ("{snap: 20}", "capture.snap: Input should be greater than or equal to 64"),
    ("{link: []}", "capture.link: unknown field (did you mean 'links'?); allowed: links, "
                   "max_bytes, snap"),
])
def test_a_bad_capture_section_names_the_field(section: str, problem: str):
    with pytest.raises(ScenarioError) as caught:
        load_scenario(CAPTURE_BASE + f"capture: {section}\n")
    assert f"<text>:4: {problem}" in str(caught.value)


def test_a_bad_capture_option_names_the_link():
    scenario = load_scenario(CAPTURE_BASE)
    with pytest.raises(ValueError, match=r"0->9 \(to\): no worker 9: workers are 0\.\.2"):
        scenario.with_capture(["0->9"])
    with pytest.raises(ValueError, match="sideways: expected a link such as"):
        scenario.with_capture(["sideways"])


def test_find_scenario_takes_a_file_or_a_shipped_name(tmp_path):
    shipped = scenario_files()[0]
    assert find_scenario(shipped.stem) == shipped
    own = tmp_path / f"{shipped.stem}.yaml"
    own.write_text("name: mine\n")
    assert find_scenario(own) == own  # a file that exists wins over a shipped name
    assert find_scenario("no-such-scenario") == Path("no-such-scenario")


# --- what a newcomer hit ------------------------------------------------------------------------

NULLABLE_BASE = ("topology: {default: {delay: 10ms, jitter: 1ms, distribution: pareto, loss: 1%, "
                 "rate: 10mbit, limit: 50, seed: 3}}\n")


@pytest.mark.parametrize("field", [info.alias or name for name, info
                                   in LinkProfile.model_fields.items()])
def test_null_in_a_link_change_resets_any_field_to_its_default(field: str):
    """Documented: null resets a field. Each field, whatever validators it has; resetting
    distribution with jitter, and jitter with its distribution, keeps the profile valid."""
    companions = {"jitter": ", distribution: null", "delay": ", jitter: null, "
                  "distribution: null"}.get(field, "")
    scenario = load_scenario(NULLABLE_BASE + f"timeline: [{{at: 1s, set_link: {{profile: "
                             f"{{{field}: null{companions}}}}}}}]\n")
    state = LinkState.of(scenario)
    state.apply(scenario.timeline[0])
    default = LinkProfile.model_fields[field.replace("-", "_")].default
    assert getattr(state.current(0, 1), field) == default


def test_collective_times_take_a_unit_like_every_other_time_of_a_scenario():
    given = load_scenario("collective: {kind: moshpit, timeout: 2s, heartbeat: 500ms, "
                          "rendezvous_timeout: 60}\n").collective.options()
    assert given == {"timeout": 2.0, "heartbeat": 0.5, "rendezvous_timeout": 60.0}
    lossy = load_scenario("collective: {kind: lossy, rate: 100mbit, settle: 2ms}\n")
    assert lossy.collective.options() == {"rate": 100e6, "settle": 0.002}


def test_the_timeline_runs_and_is_checked_in_time_order_and_check_says_so(tmp_path: Path):
    path = tmp_path / "late-kill.yaml"
    path.write_text("collective: {kind: moshpit}\njob: {strategy: average}\ntimeline:\n"
                    "  - {at: 20s, restart: 1}\n  - {at: 10s, kill: 1}\n  - {step: 3, kill: 2}\n"
                    "  - {at: 5s, kill: 3}\n")
    scenario = load_scenario(path)
    assert run_order(scenario.timeline) == [3, 1, 2, 0]  # each clock in order, in its places
    result = CliRunner().invoke(app, ["scenario", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert ("note: timeline: runs in time and step order, not the file's: [3] at 5s, [1] at "
            "10s, [2] step 3, [0] at 20s") in result.output


def refusal(source: str | Path) -> ScenarioError:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(source)
    return caught.value


def test_a_refused_field_is_neither_offered_nor_in_the_schema():
    (problem,) = refusal("job: {sed: 3}\n").problems
    assert "did you mean" not in problem.message and "seed" not in problem.message
    assert "seed" not in json_schema()["$defs"]["TrainConfig"]["properties"]


def test_a_binary_file_is_a_scenario_error(tmp_path: Path):
    path = tmp_path / "photo.yaml"
    path.write_bytes(bytes(range(256)))
    (problem,) = refusal(path).problems
    assert problem.message.startswith("not a text file (UTF-8): byte 0x80 at offset 128")


def test_check_takes_shipped_names_and_says_what_a_command_job_lacks(tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(app, ["scenario", "check", "quickstart"])
    assert result.exit_code == 0 and result.output.startswith("ok quickstart: quickstart:")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text("")
    cases = {"cwd: nowhere": ("job.cwd", f"no directory {tmp_path / 'nowhere'}"),
             "command: [no-such-program-here]": ("job.command[0]", "no program "
                                                 "'no-such-program-here' on the workers' PATH"),
             "command: [./run.sh]": ("job.command[0]", f"no program './run.sh' in {tmp_path}"),
             "command: [python, train.py]": ("job.command[1]", f"no file train.py in {tmp_path}"),
             "command: [python, train.py], cwd: job": None}
    for job, expected in cases.items():
        path = tmp_path / "s.yaml"
        fields = job if job.startswith("command") else f"command: [python, t.py], {job}"
        path.write_text(f"job: {{{fields}}}\n")
        load_scenario(path)  # as a Compose worker reads it: the files are not looked for
        result = runner.invoke(app, ["scenario", "check", "--json", str(path)])
        (entry,) = json.loads(result.output)
        if expected is None:
            assert entry["ok"], entry
            continue
        assert result.exit_code == 2 and not entry["ok"], entry
        (problem,) = entry["problems"]
        assert problem["path"] == expected[0] and expected[1] in problem["message"], problem


TRACED = """
name: traced
workers: 3
topology:
  default: {{loss: 1%}}
  links:
    - {{between: [0, 1], {link}}}
job: {{model: mlp, steps: 5}}
"""


def test_traced_links_read_their_trace_relative_to_the_scenario(tmp_path: Path):
    """A link with a trace and no profile replays it on top of the default; the file is the
    scenario directory's; the summary counts the traced links."""
    (tmp_path / "cap.csv").write_text("time,rate\n0,10mbit\n1s,2mbit\n2s,2mbit\n")
    path = tmp_path / "traced.yaml"
    path.write_text(TRACED.format(link="trace: {file: cap.csv, resolution: 50ms}"))
    scenario = load_scenario(path)
    traces = scenario.traces()
    assert set(traces) == {(0, 1), (1, 0)}
    assert traces[(0, 1)].file == str(tmp_path / "cap.csv")
    assert scenario.link_profile(0, 1) == LinkProfile.parse(loss="1%")
    plan = traces[(0, 1)].schedule()
    assert (plan.resolution, plan.windows) == (0.05, 40)
    assert "2 link(s) replaying a trace" in scenario.summary()
    assert scenario.with_steps(2).traces() == traces  # derived scenarios keep them


@pytest.mark.parametrize(("link", "where", "message"), [
    ("trace: {file: cap.csv}", "topology.links[0].trace", "cap.csv:3: rate: expected a rate"),
    ("trace: {file: none.csv}", "topology.links[0].trace", "No such file or directory"),
    ("trace: {file: cap.csv, resolution: 1ms}", "topology.links[0].trace.resolution",
     "greater than or equal to 0.01"),
    ("trace: {file: cap.csv, format: pcap}", "topology.links[0].trace.format", "mahimahi"),
    ("profile: null", "topology.links[0]", "give a profile, a trace, or both"),
])
def test_a_bad_trace_is_refused_naming_the_field_and_the_line(tmp_path: Path, link, where,
                                                              message):
    (tmp_path / "cap.csv").write_text("time,rate\n0,10mbit\n1s,fast\n")
    path = tmp_path / "traced.yaml"
    path.write_text(TRACED.format(link=link))
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    problems = {problem.path: problem.message for problem in caught.value.problems}
    assert where in problems and message in problems[where], problems
