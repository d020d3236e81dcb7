"""`testbed run` end to end on the host kernel (root, namespaces, the fallback's loss): a small
scenario trains across shaped links, the run directory holds every worker's steps and the
timeline's faults, the report renders, and nothing of the network is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from netem.lab import lab_namespaces
from testbed.cli import app
from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns

STEPS = 6
SCENARIO = f"""
name: run-e2e
seed: 3
workers: 3
topology:
  default: {{loss: 2%}}
job: {{model: mlp, steps: {STEPS}, batch: 32}}
collective: {{kind: ring}}
timeline:
  - step: 3
    set_link: {{link: {{from: 0, to: 1}}, profile: {{loss: 20%}}}}
"""


def test_a_scenario_runs_end_to_end_and_leaves_no_network(tmp_path: Path):
    scenario = tmp_path / "run-e2e.yaml"
    scenario.write_text(SCENARIO)
    cluster = ClusterRun(scenario, run_dir=tmp_path / "run")
    seen: list[int] = []
    result = cluster.run(lambda workers: seen.append(min(w.step for w in workers)))

    assert result.success, result.error
    assert [w.status for w in result.workers] == ["done"] * 3
    assert all(w.step == STEPS - 1 for w in result.workers)
    assert seen and seen[-1] == STEPS - 1, "the display never saw the last step"
    run = load_run(result.run_dir)
    steps = {(event.rank, event.step) for event in run.steps}
    assert steps == {(rank, step) for rank in range(3) for step in range(STEPS)}
    (fault,) = run.faults
    assert fault.action == "set_link" and fault.fields.get("step") == 3
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["success"] is True
    assert result.html is not None and result.html.exists()
    prefix = next(event for event in run.other if event.get("type") == "cluster")["prefix"]
    assert lab_namespaces(prefix) == [], "the run left namespaces behind"


def test_cli_refuses_a_bad_scenario_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nworkers: 3\ncollective: {kind: rign}\n")
    result = CliRunner().invoke(app, ["run", str(bad), "--sandbox", "none"])
    assert result.exit_code == 2
    assert "collective.kind" in result.output


def test_the_quickstart_runs_in_a_guest_when_this_kernel_lacks_netem(tmp_path: Path):
    """The README's main job, shortened: `testbed run quickstart` needs netem's delay; on a
    kernel without sch_netem it runs the whole cluster in a UML guest and says so."""
    from netem.capabilities import netem_available

    out = tmp_path / "quickstart"
    result = CliRunner().invoke(app, ["run", "quickstart", "--steps", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    if not netem_available():
        assert "running in a User-Mode Linux guest" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["success"] is True
    run = load_run(out)
    assert {(event.rank, event.step) for event in run.steps} == {
        (rank, step) for rank in range(4) for step in range(3)}
    assert (out / "index.html").exists()
