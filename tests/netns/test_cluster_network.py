"""The cluster's network on the host kernel (root, real namespaces, the fallback backend here):
the right links are shaped, changes take effect, partitions cut and heal, nothing is left."""

from __future__ import annotations

import threading

import pytest

import netem
from netem.lab import lab_namespaces
from netem.plan import UnsupportedByKernel
from netem.probe import probe
from netem.profile import LinkProfile
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.timeline import Timeline
from testbed.scenario import load_scenario
from testbed.scenario.links import CUT

pytestmark = pytest.mark.netns

SCENARIO = """
name: cluster-network
topology:
  links:
    - {from: 0, to: 1, profile: {loss: 30%}}
  mtu: 1400
  congestion: cubic
workers:
  count: 3
  overrides:
    - {worker: 2, congestion: bbr}
"""


def kernel_profile(network: ClusterNetwork, src: int, dst: int) -> LinkProfile:
    """What the kernel shapes src -> dst with: the receiver's rule for src, else its catch-all."""
    rules = netem.show(network.switch_port(dst), netns=network.lab.switch)
    return rules.get(network.hosts[src], rules[None])


def kernel_table(network: ClusterNetwork) -> dict[tuple[int, int], LinkProfile]:
    return {(s, d): kernel_profile(network, s, d)
            for s in range(network.count) for d in range(network.count) if s != d}


def loss(network: ClusterNetwork, src: int, dst: int, count: int = 1500) -> float:
    result = probe(network.namespace(src), network.namespace(dst), network.hosts[dst],
                   count=count, interval=0.0002, timeout=5.0)
    assert result.receiver_drops == 0
    return result.loss_ratio


@pytest.fixture
def network():
    scenario = load_scenario(SCENARIO)
    with ClusterNetwork(scenario, backend="fallback") as built:
        yield built
    assert lab_namespaces(built.prefix) == []


def test_exactly_the_scenario_links_are_shaped_and_measured(network):
    lossy = LinkProfile.parse(loss="30%")
    expected = {pair: (lossy if pair == (0, 1) else LinkProfile())
                for pair in kernel_table(network)}
    assert kernel_table(network) == expected
    assert network.links.current(0, 1) == lossy
    assert 0.22 < loss(network, 0, 1) < 0.38
    assert loss(network, 1, 0) == 0.0
    assert loss(network, 2, 1) == 0.0


def test_hosts_namespaces_mtu_and_congestion_control(network):
    assert network.hosts == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    mtu = network.lab.run(network.lab.hosts[0], ["cat", "/sys/class/net/eth0/mtu"])
    assert mtu.stdout.strip() == "1400"
    assert network.congestion == {0: "cubic", 1: "cubic", 2: "bbr"}
    assert [network.read_congestion(w) for w in range(3)] == ["cubic", "cubic", "bbr"]


def test_set_link_takes_effect_in_the_kernel_and_is_timed(network):
    seconds = network.set_link(1, 2, LinkProfile.parse(loss="10%", rate="50mbit"))
    print(f"\nset_link, a new source rule (rebuilds one receiver): {seconds * 1000:.1f} ms")
    assert seconds < 1.0
    seconds = network.set_link(1, 2, LinkProfile.parse(loss="10%", rate="50mbit"))
    print(f"set_link, in place (one receiver, fallback backend): {seconds * 1000:.1f} ms")
    assert seconds < 1.0
    assert kernel_profile(network, 1, 2) == LinkProfile.parse(loss="10%", rate="50mbit")
    assert kernel_profile(network, 0, 2) == LinkProfile()
    # a second change of the same link is in place (the receiver's layout stays)
    seconds = network.set_links({(1, 2): LinkProfile.parse(loss="20%"),
                                 (0, 1): LinkProfile.parse(loss="5%")})
    print(f"set_links (two receivers, in place): {seconds * 1000:.1f} ms")
    assert seconds < 1.0
    table = kernel_table(network)
    assert table[(1, 2)] == LinkProfile.parse(loss="20%")
    assert table[(0, 1)] == LinkProfile.parse(loss="5%")
    assert {pair for pair, profile in table.items() if not profile.is_perfect} == {(1, 2), (0, 1)}


def test_partition_cuts_and_heal_restores(network):
    network.partition([(1, 0), (0, 1)])
    cut = CUT
    assert cut.loss == 1.0
    assert kernel_profile(network, 1, 0) == cut and kernel_profile(network, 0, 1) == cut
    assert loss(network, 1, 0, count=300) == 1.0
    # a change to a cut link is remembered, and it stays cut
    network.set_link(0, 1, LinkProfile.parse(loss="10%"))
    assert kernel_profile(network, 0, 1) == cut and network.links.is_cut(0, 1)
    network.heal()
    assert network.links.cut == set()
    assert kernel_profile(network, 0, 1) == LinkProfile.parse(loss="10%")
    assert kernel_profile(network, 1, 0) == LinkProfile()
    assert loss(network, 1, 0, count=300) == 0.0


def test_a_profile_the_fallback_cannot_shape_is_a_clear_error_and_leaves_nothing():
    scenario = load_scenario("workers: 2\ntopology: {default: {delay: 10ms}}")
    network = ClusterNetwork(scenario, backend="fallback")
    with pytest.raises(UnsupportedByKernel, match="delay"), network:
        pass
    assert lab_namespaces(network.prefix) == []


def test_a_timeline_change_the_fallback_cannot_make_fails_before_the_run():
    scenario = load_scenario("""
workers: 2
timeline:
  - {at: 5s, set_link: {link: {from: 0, to: 1}, profile: {delay: 20ms}}}
""")
    network = ClusterNetwork(scenario, backend="fallback")
    with pytest.raises(UnsupportedByKernel, match=r"timeline\[0\].*0->1.*delay"), network:
        pass
    assert lab_namespaces(network.prefix) == []


def test_close_is_idempotent_and_removes_everything():
    network = ClusterNetwork(load_scenario("workers: 2"), backend="fallback")
    with network:
        assert len(lab_namespaces(network.prefix)) == 3
    network.close()
    assert lab_namespaces(network.prefix) == []


TIMELINE = """
name: cluster-timeline
workers: 3
topology:
  groups: {east: [0], west: [1, 2]}
timeline:
  - {at: 0.1s, set_link: {link: {from: 2, to: 0}, profile: {loss: 40%}}}
  - {at: 0.2s, ramp_link: {link: {from: 1, to: 0}, to: {loss: 20%}, over: 0.4s, every: 0.2s}}
  - {at: 0.3s, partition: east}
  - {at: 0.7s, heal: all}
"""


def test_the_timeline_drives_the_real_network():
    records: list[dict] = []
    done = threading.Event()

    def on_event(record):
        records.append(record)
        if record["action"] == "heal":
            done.set()

    scenario = load_scenario(TIMELINE)
    with ClusterNetwork(scenario, backend="fallback") as network:
        timeline = Timeline(scenario.timeline, network, on_event)
        timeline.start()
        try:
            assert done.wait(15), f"the timeline did not finish: {records}"
        finally:
            assert timeline.stop(timeout=2.0)
        actions = [r["action"] for r in records]
        assert actions[:2] == ["set_link", "ramp_link"] and actions[-1] == "heal"
        assert actions.count("ramp_step") == 2 and not timeline.errors
        print("\n" + "\n".join(f"{r['action']:>10} due {r['scheduled']:.3f}s late "
                              f"{r['late'] * 1000:.0f} ms" for r in records))
        assert all(r["late"] < 1.0 for r in records)
        assert network.links.cut == set()
        assert kernel_profile(network, 2, 0) == LinkProfile.parse(loss="40%")
        assert kernel_profile(network, 1, 0) == LinkProfile.parse(loss="20%")
        assert kernel_profile(network, 0, 1) == LinkProfile()
    assert lab_namespaces(network.prefix) == []
