"""The replay of traced links against a Compose node's link state (`IngressLinks` before its
`start`, when changes are only remembered: no kernel, no root): only the links into the node
are replayed there, a node that joins late joins the traces where they are, and each window's
profile is the trace's values on top of the link's own."""

from __future__ import annotations

from pathlib import Path

from live import wait_for

from netem.profile import LinkProfile
from testbed.cluster.node import IngressLinks
from testbed.cluster.replay import LinkReplay
from testbed.scenario import load_scenario

SCENARIO = """
name: traced
workers: 3
topology:
  default: {delay: 10ms}
  links:
    - {from: 0, to: 1, trace: {file: step.csv, loop: false, resolution: 50ms}}
    - {from: 2, to: 0, trace: {file: step.csv}}
job: {model: mlp, steps: 5}
"""
# 20 Mbit/s for 0.3 s, then 5 Mbit/s for 0.3 s; the trace ends at 0.6 s.
STEP = "time,rate\n0,20mbit\n300ms,5mbit\n600ms,\n"


def test_a_node_replays_its_own_links_from_where_the_trace_is(tmp_path: Path):
    (tmp_path / "step.csv").write_text(STEP)
    scenario = load_scenario(SCENARIO, base_dir=tmp_path)
    network = IngressLinks(scenario, 1, ["198.18.0.1", "198.18.0.2", "198.18.0.3"], "eth0")
    own = {pair: trace for pair, trace in scenario.traces().items() if pair[1] == 1}
    assert set(own) == {(0, 1)}
    replay = LinkReplay(network, own).start(elapsed=0.35)  # joins in the second window
    try:
        assert network.links.current(0, 1) == LinkProfile.parse(delay="10ms", rate="5mbit")
        wait_for("the link's own profile at the trace's end", lambda: network.links.current(0, 1),
                 lambda profile: profile == LinkProfile.parse(delay="10ms"), 10.0, every=0.01)
    finally:
        replay.stop()
    assert network.links.current(2, 0) == LinkProfile.parse(delay="10ms")  # not this node's
    assert replay.summary()["changes"] == 1  # the end; the window it joined in was set at once
