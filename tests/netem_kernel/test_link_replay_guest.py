"""A scenario's traced link replayed with netem (the UML guest here): the capacity on the wire
follows the trace's windows while the link keeps its profile's delay, through the cluster's
link state, and the link goes back to its profile at the trace's end."""

from __future__ import annotations

from pathlib import Path

import pytest
from live import wait_for

import netem
from netem.probe import measure_rate, probe
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.replay import LinkReplay
from testbed.scenario import load_scenario

pytestmark = pytest.mark.netem_kernel

# Four seconds at 30 Mbit/s, four at 6 (the guest's one vCPU sends 75 Mbit/s of full frames).
STEP = "time,rate\n0,30mbit\n4s,6mbit\n8s,6mbit\n"
SCENARIO = """
name: traced-netem
workers: 2
topology:
  links:
    - {from: 0, to: 1, profile: {delay: 20ms, limit: 1000}, trace: {file: step.csv, loop: false}}
job: {model: mlp, steps: 5}
"""


def test_a_traced_link_follows_its_trace_with_netem_and_keeps_its_delay(tmp_path: Path):
    """Rates judged within 15% (docs/probes.md: the bulk train measures a shaper within a few
    percent), the delay's median within 2 ms of 20 ms (the guest's timing floor)."""
    (tmp_path / "step.csv").write_text(STEP)
    scenario = load_scenario(SCENARIO, base_dir=tmp_path)
    with ClusterNetwork(scenario, backend="netem") as network:
        def rate() -> int | None:
            rules = netem.show(network.switch_port(1), netns=network.lab.switch)
            return rules.get(network.hosts[0], rules[None]).rate

        source, target, address = network.namespace(0), network.namespace(1), network.hosts[1]
        replay = LinkReplay(network, scenario.traces()).start()
        try:
            fast = measure_rate(source, target, address, duration=1.0, offered=40e6)
            wait_for("the trace's second window (6 Mbit/s) in the kernel", rate,
                     lambda value: value == 6_000_000, 15.0, every=0.05)
            slow = measure_rate(source, target, address, duration=1.0, offered=8e6)
            delay = probe(source, target, address, count=500, interval=0.002)
            wait_for("the link back to its own profile at the trace's end", rate,
                     lambda value: value is None, 15.0, every=0.05)
        finally:
            replay.stop()
    assert fast.rate == pytest.approx(30e6, rel=0.15), fast
    assert slow.rate == pytest.approx(6e6, rel=0.15), slow
    assert delay.delay_percentiles[50] == pytest.approx(0.020, abs=0.002), delay
    assert replay.summary()["changes"] == 2
