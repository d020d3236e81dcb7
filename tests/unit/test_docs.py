"""The documentation's examples work: every fenced example of README.md and docs/ is run where
it can run without root, a network, a guest or Docker, and is otherwise skipped by design with
its reason written here; a new example that is neither fails until it is listed.

- YAML of a scenario (or of some of its sections) goes through the loader: alone, or where it
  names what other sections hold (groups, a long enough job) over `CONTEXT`.
- `testbed` commands go through the command line (typer's CliRunner) from a scratch directory,
  the checkout's files given by their path there, whatever a command writes kept in the
  scratch directory (an `-o`, and one added to `compose`).
- Python examples run where they stand alone (`PYTHON_RUN`); the others are fragments that
  name the reader's objects, or need root: `PYTHON_SKIPPED` says which.
"""

from __future__ import annotations

import glob
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from testbed.cli import app
from testbed.scenario import Scenario, ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Example:
    """One fenced block of a document (or one command of a shell block)."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def first(self) -> str:
        """Its first line, without a comment: what names it in the listings below."""
        line = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return line.split("  #")[0].strip()

    def __str__(self) -> str:
        return f"{self.path.name}:{self.line}"


def examples() -> list[Example]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            found.append(Example(path, line, match.group(1), match.group(2)))
    return found


EXAMPLES = examples()


# --- scenarios ----------------------------------------------------------------------------------

SECTIONS = set(Scenario.model_fields)
# What the docs' partial examples lean on: eight workers in groups east and west, a job long
# enough for their steps, a collective that takes a worker back.
CONTEXT = {"workers": 8, "topology": {"groups": {"east": [0, 1, 2, 3], "west": [4, 5, 6, 7]}},
           "job": {"steps": 300}, "collective": {"kind": "moshpit"}}
# YAML examples that are not scenario sections: how each is checked, or why it is not.
YAML_OTHER = {
    ("compression.md", "feedback: ef21m"):
        lambda data: {"collective": {"kind": "ring", "compressor": {"kind": "topk", **data}}},
    ("scenarios.md", "# yaml-language-server: $schema=scenario.schema.json"):
        "an editor's comment line: no YAML of its own",
    ("grafana.md", "# prometheus.yml"): "Prometheus's own configuration, not the testbed's",
    ("conditions.md", "topology:"): lambda data: _with_test_traces(data),
}
TEST_DATA = Path(__file__).parents[1] / "data"


def _with_test_traces(data: dict) -> dict:
    """An example's scenario with each link trace's file one of tests/data's traces of the
    same format, as the reader's own files are not here."""
    for link in data["topology"]["links"]:
        name = link["trace"]["file"]
        link["trace"]["file"] = str(TEST_DATA / ("step.csv" if name.endswith(".csv")
                                                 else "step.mahimahi"))
    return data


def _merged(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (_merged(base[key], value) if isinstance(value, dict)
                       and isinstance(base.get(key), dict) else value)
    return merged


def _load(data: dict) -> Scenario:
    """`data` as a scenario: alone, or over `CONTEXT` where it leans on it."""
    try:
        return load_scenario(yaml.safe_dump(data))
    except ScenarioError:
        return load_scenario(yaml.safe_dump(_merged(CONTEXT, data)))


YAML = [example for example in EXAMPLES if example.lang == "yaml"]


@pytest.mark.parametrize("example", YAML, ids=str)
def test_every_yaml_example_is_a_scenario_the_loader_takes(example: Example):
    data = yaml.safe_load(example.text)  # every one is YAML
    other = YAML_OTHER.get((example.path.name, example.first))
    if isinstance(other, str):
        pytest.skip(other)
    if other is not None:
        data = other(data)
    assert isinstance(data, dict) and set(data) <= SECTIONS, (
        f"{example}: not a scenario's sections: list it in YAML_OTHER with how to check it")
    _load(data)


# --- commands -----------------------------------------------------------------------------------

# Commands that need what a unit test has not: each pattern (on the command) with the reason.
COMMAND_SKIPPED = [
    (r"^testbed run ", "runs a scenario: root and network namespaces, or a User-Mode Linux "
                       "guest (tests/netns, tests/netem_kernel run scenarios)"),
    (r"--up\b", "runs the project on Docker (tests/compose)"),
    (r"^testbed capture ", "reads the pcap files of a run's directory, which a run makes"),
    (r"^testbed report ", "renders a run's directory, which a run makes (tests/unit/"
                          "test_report.py renders written ones)"),
    (r"^testbed probe ", "sends probe trains between a lab's namespaces: root"),
    (r"^testbed shape (?!.*--dry-run)", "shapes a lab's interface in its namespace: root"),
    (r"^testbed dashboards$", "rewrites the committed dashboards (--check runs here)"),
    (r"^testbed compose SCENARIO\b", "a placeholder for a scenario"),
    (r"^(docker|scripts/compose-images\.sh|\w+_IMAGE=)", "Docker"),
    (r"^python -m netem\.sandbox ", "a User-Mode Linux guest"),
    (r"^pytest ", "the reader's own suite (examples/pytest-suite is the docs' one)"),
    (r"^make ", "installs the distribution's packages, then root, Docker and a guest"),
    (r"^pip install ", "the package index: a network"),
    (r"^wireshark ", "a desktop program"),
    (r"^prometheus ", "a Prometheus server"),
]


def commands() -> list[tuple[Example, str]]:
    """Every command of the shell examples, and every `$ ` line of the others, continuation
    lines joined, comments dropped."""
    found = []
    for example in EXAMPLES:
        if example.lang not in ("sh", ""):
            continue
        joined = example.text.replace("\\\n", " ")
        for line in joined.splitlines():
            if example.lang == "" and not line.startswith("$ "):
                continue
            command = line.removeprefix("$ ").split(" #")[0].strip()
            if command and not command.startswith("#"):
                found.append((example, " ".join(command.split())))
    return found


COMMANDS = commands()


def _argv(command: str, scratch: Path) -> list[str]:
    """`command`'s arguments after `testbed`, the checkout's files by their path (globs
    expanded there), what it writes in `scratch`."""
    words = shlex.split(command)[1:]
    argv: list[str] = []
    for word in words:
        if any(c in word for c in "*?["):
            argv += sorted(glob.glob(str(ROOT / word)))
        elif "/" in word and not word.startswith("-") and (ROOT / word).exists():
            argv.append(str(ROOT / word))
        else:
            argv.append(word)
    if words[0] == "compose" and not {"-o", "--out"} & set(words):
        argv += ["-o", str(scratch / "project")]  # not build/ of the checkout
    return argv


@pytest.mark.parametrize(("example", "command"), COMMANDS,
                         ids=[f"{example}: {command}" for example, command in COMMANDS])
def test_every_documented_command_runs_or_is_skipped_by_design(example: Example, command: str,
                                                               tmp_path: Path, monkeypatch):
    reason = next((why for pattern, why in COMMAND_SKIPPED if re.search(pattern, command)),
                  None)
    if reason is not None:
        pytest.skip(reason)
    assert command.startswith("testbed "), (
        f"{example}: {command!r} is neither run nor skipped: add it to COMMAND_SKIPPED")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, _argv(command, tmp_path))
    assert result.exit_code == 0, (command, result.output)


# --- Python -------------------------------------------------------------------------------------

# Python examples that run as they stand, and what each needs beside it.
PYTHON_RUN = {
    ("scenarios.md", "from testbed.scenario import load_scenario, ScenarioError"): {},
    ("profiles.md", "from netem import LinkProfile"):
        {"rtt.txt": "".join(f"{20 + (i % 7) * 0.5}\n" for i in range(200))},
}
ROOT_NEEDED = "shapes or measures a lab's links: root and network namespaces"
FRAGMENT = "a fragment: it names the reader's own objects (ranks, addresses, a model, a job)"
SIGNATURES = "a listing of signatures, not a program"
PYTEST = "a test of the reader's suite, for the pytest plugin (tests/netns runs its own)"
PYTHON_SKIPPED = {
    ("README.md", "model.register_comm_hook(None, testbed.ddp.scenario_hook())"): FRAGMENT,
    ("README.md", "from netem import LinkProfile, apply, show, clear"): ROOT_NEEDED,
    ("README.md", '@pytest.mark.netem(delay="50ms", loss="5%")'): PYTEST,
    ("conditions.md", "def test_training_over_a_cellular_uplink(make_netem_network):"): PYTEST,
    ("capture.md", "from netem.lab import Lab"): ROOT_NEEDED,
    ("cluster.md", "with ClusterNetwork(scenario) as network:"): FRAGMENT,
    ("collectives.md", "averaged, stats = collective.allreduce(tensor, step)"): FRAGMENT,
    ("collectives.md", "from testbed.collectives import create"): FRAGMENT,
    ("collectives.md", "new_parameters, stats = lossy.step(parameters_flat, gradient_flat, "
                       "step, update)"): FRAGMENT,
    ("collectives.md", "import torch.distributed as dist"): FRAGMENT,
    ("collectives.md", "from netem import LinkProfile"): ROOT_NEEDED,
    ("compression.md", "from testbed.collectives import compress, create"): FRAGMENT,
    ("compression.md", "model = DistributedDataParallel(net)"): FRAGMENT,
    ("conditions.md", "from netem import LinkProfile, Replay, load_trace, schedule"):
        ROOT_NEEDED,
    ("metrics.md", "from testbed.metrics import WorkerMetrics, drift_from, gather_over, "
                   "projection"): FRAGMENT,
    ("moshpit.md", "from testbed.collectives.moshpit import Moshpit"): FRAGMENT,
    ("moshpit.md", 'Moshpit(rank, world, *, store, listen=("127.0.0.1", 0), serve_store=None, '
                   "group_size=4,"): SIGNATURES,
    ("netlink.md", 'add_netem(ipr, ifindex, parent, handle, profile, *, command="add", '
                   "annotate=None)"): SIGNATURES,
    ("netlink.md", "netem_tc_args(profile) -> list[str]"): SIGNATURES,
    ("probes.md", "from netem.probe import compare, offered_load, probe"): ROOT_NEEDED,
    ("pytest.md", "import sys"): PYTEST,
    ("pytest.md", "def test_training_survives_loss(netem_scenario):"): PYTEST,
    ("report.md", "from testbed.report import RunWriter, render_run"): FRAGMENT,
    ("sandbox.md", "from netem import sandbox"): "a User-Mode Linux guest",
    ("shaping.md", "from netem import LinkProfile, apply, change, show, clear"): ROOT_NEEDED,
    ("training.md", "from testbed.train import TrainConfig, train"): FRAGMENT,
    ("transport.md", "from testbed.transport import DatagramEndpoint, Kind, Landing, "
                     "expected_chunks"): FRAGMENT,
    ("transport.md", "from testbed.transport import Listener, StreamMesh, Kind"): FRAGMENT,
    ("your-code.md", "from testbed.ddp import scenario_hook"): FRAGMENT,
}
PYTHON = [example for example in EXAMPLES if example.lang == "python"]


@pytest.mark.parametrize("example", PYTHON, ids=str)
def test_every_python_example_runs_or_is_skipped_by_design(example: Example, tmp_path: Path,
                                                           monkeypatch):
    key = (example.path.name, example.first)
    if key in PYTHON_SKIPPED:
        pytest.skip(PYTHON_SKIPPED[key])
    assert key in PYTHON_RUN, (f"{example}: neither run nor skipped: add {key} to PYTHON_RUN "
                               "or PYTHON_SKIPPED")
    for name, content in PYTHON_RUN[key].items():
        (tmp_path / name).write_text(content)
    for path in ("compose", "examples"):  # the checkout's files, by the paths the docs use
        (tmp_path / path).symlink_to(ROOT / path)
    monkeypatch.chdir(tmp_path)
    exec(compile(example.text, str(example), "exec"), {})


def test_every_listed_example_is_still_in_the_docs():
    """A listing of an example that changed or went is stale: update it."""
    present = {(example.path.name, example.first) for example in EXAMPLES}
    for key in [*PYTHON_RUN, *PYTHON_SKIPPED, *YAML_OTHER]:
        assert key in present, f"{key} is listed here but no longer in the docs"


def test_the_license_pyproject_names_is_the_one_shipped():
    import tomllib

    named = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert named == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
