"""Links that replay a recorded trace in the namespace cluster (root; the fallback backend here,
which shapes a trace's rate with htb): the capacity on the wire follows the trace, the replay
goes through the cluster's link state, a scenario run replays its traced links from the start
of training, and nothing is left."""

from __future__ import annotations

from pathlib import Path

import pytest
from live import wait_for

import netem
from netem.lab import lab_namespaces
from netem.probe import measure_rate
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.replay import LinkReplay
from testbed.cluster.runner import ClusterRun
from testbed.report import load_run
from testbed.scenario import load_scenario

pytestmark = pytest.mark.netns

# Three seconds at 30 Mbit/s, three at 6, then the trace ends (no loop): the link goes back to
# its own profile (a queue of 500 packets, no rate).
STEP = "time,rate\n0,30mbit\n3s,6mbit\n6s,6mbit\n"
SCENARIO = """
name: traced
workers: 2
topology:
  links:
    - {{from: 0, to: 1, profile: {{limit: 500}}, trace: {{file: {trace}, loop: false}}}}
job: {{model: mlp, steps: 5}}
"""


def kernel_rate(network: ClusterNetwork) -> int | None:
    """The rate the kernel shapes 0 -> 1 with now."""
    rules = netem.show(network.switch_port(1), netns=network.lab.switch)
    return rules.get(network.hosts[0], rules[None]).rate


def test_a_traced_link_carries_the_traces_capacity_window_by_window(tmp_path: Path):
    """A sender above the trace's peak gets 30 Mbit/s in the first window and 6 in the
    second; the traced link changes in place (its queue limit stays), the others are untouched, and
    the link goes back to its profile when the trace ends. The measured rates are judged
    within 15% (the probe's bulk train measures a shaper to within a few percent: docs/
    probes.md); the ratio of the two windows is 5."""
    (tmp_path / "step.csv").write_text(STEP)
    scenario = load_scenario(SCENARIO.format(trace="step.csv"), base_dir=tmp_path)
    assert set(scenario.traces()) == {(0, 1)}
    with ClusterNetwork(scenario, backend="fallback") as network:
        replay = LinkReplay(network, scenario.traces()).start()
        try:
            assert kernel_rate(network) == 30_000_000
            fast = measure_rate(network.namespace(0), network.namespace(1), network.hosts[1],
                                duration=0.7, offered=40e6)
            wait_for("the trace's second window (6 Mbit/s) in the kernel",
                     lambda: kernel_rate(network), lambda rate: rate == 6_000_000, 10.0,
                     every=0.05)
            slow = measure_rate(network.namespace(0), network.namespace(1), network.hosts[1],
                                duration=0.7, offered=8e6)
            assert network.links.current(0, 1).limit == 500
            assert network.links.current(1, 0).rate is None
            wait_for("the link back to its own profile at the trace's end",
                     lambda: kernel_rate(network), lambda rate: rate is None, 10.0, every=0.05)
        finally:
            replay.stop()
        summary = replay.summary()
    assert lab_namespaces(network.prefix) == []
    assert fast.rate == pytest.approx(30e6, rel=0.15), fast
    assert slow.rate == pytest.approx(6e6, rel=0.15), slow
    assert summary["links"] == ["0->1"] and summary["changes"] == 2, summary


def test_a_scenario_run_replays_its_traced_links_from_the_start_of_training(tmp_path: Path):
    """A looping trace of 100 ms windows changes the link many times during a run of a few
    seconds; the run records what the replay did and succeeds."""
    trace = tmp_path / "flap.csv"
    trace.write_text("time,rate,loss\n0,50mbit,0%\n100ms,20mbit,1%\n200ms,50mbit,0%\n")
    path = tmp_path / "traced.yaml"
    path.write_text(SCENARIO.format(trace="flap.csv").replace("loop: false", "loop: true")
                    .replace("steps: 5", "steps: 20, straggler: {fixed: 100ms}"))
    result = ClusterRun(path, run_dir=tmp_path / "run", backend="fallback").run()

    assert result.success, result.error
    (replay,) = [e for e in load_run(result.run_dir).other if e.get("type") == "replay"]
    assert replay["links"] == ["0->1"] and replay["traces"] == [str(trace)]
    assert replay["changes"] >= 5, replay  # 20 steps of 100 ms at least: two changes per 200
