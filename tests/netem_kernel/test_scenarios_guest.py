"""Every shipped scenario (compose/scenarios/) runs end to end on a netem kernel (the UML guest
here: they all ask for delay, which only sch_netem shapes), shortened by a step override as CI
allows: every worker that the timeline does not kill runs every step, the links are shaped with
netem, the timeline's step events within the shortened run fire at their steps, and the run
directory holds the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster.runner import ClusterRun
from testbed.report import load_run
from testbed.scenario import load_scenario

pytestmark = pytest.mark.netem_kernel

SCENARIOS = sorted((Path(__file__).parents[2] / "compose" / "scenarios").glob("*.yaml"))
STEPS = 8


def test_the_shipped_scenarios_are_all_here():
    assert {path.stem for path in SCENARIOS} == {
        "quickstart", "loss-1", "loss-5", "loss-10", "loss-20", "jitter-wan", "bandwidth-100mbit",
        "two-regions", "stragglers", "preemption", "cross-traffic"}


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda path: path.stem)
def test_a_shipped_scenario_runs_shortened(path: Path, tmp_path: Path):
    scenario = load_scenario(path, steps=STEPS)
    result = ClusterRun(path, steps=STEPS, run_dir=tmp_path / "run", backend="netem").run()

    assert result.success, result.error
    run = load_run(result.run_dir)
    cluster = next(event for event in run.other if event.get("type") == "cluster")
    assert cluster["backend"] == "netem"
    killed = {worker for event in scenario.timeline if event.action == "kill"
              for worker in event.kill or ()}
    for rank in set(range(scenario.count)) - killed:
        steps = sorted(event.step for event in run.steps if event.rank == rank)
        assert steps == list(range(STEPS)), f"worker {rank} ran steps {steps}"
    due = sorted((event.step, event.action) for event in scenario.timeline
                 if event.step is not None)
    fired = sorted((fault.fields["step"], fault.action) for fault in run.faults
                   if "step" in fault.fields)
    assert fired == due, "a step event of the shortened run did not fire"
    assert not [fault for fault in run.faults if fault.fields.get("error")], run.faults
    assert result.html is not None and result.html.exists()
    flows = run.traffic()
    assert set(flows) == {name for name, flow in scenario.flows().items() if flow.start == 0}, \
        "a flow due from the start did not send"
