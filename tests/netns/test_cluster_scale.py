"""The cluster's network at 16 workers on the host kernel (root, the fallback here): every
directed pair is shaped as the scenario says, changes of every link at once (in place, and
rebuilding several lossy receivers together) reach the kernel, and close leaves nothing.
Timings belong to benchmarks/scale.py, not here."""

from __future__ import annotations

import pytest

import netem
from netem.lab import lab_namespaces
from netem.profile import LinkProfile
from testbed.cluster.network import ClusterNetwork
from testbed.scenario import Scenario
from testbed.scenario.links import CUT

pytestmark = pytest.mark.netns

WORKERS = 16


def scenario(*, announced: bool) -> Scenario:
    data: dict = {"workers": WORKERS, "topology": {"default": {"loss": "1%"}}}
    if announced:  # a later change of every link: each gets a source rule from the start
        data["timeline"] = [{"at": 3600, "set_link": {"profile": {"loss": "2%"}}}]
    return Scenario.model_validate(data)


def kernel_table(network: ClusterNetwork) -> dict[tuple[int, int], LinkProfile]:
    """What the kernel shapes each directed link with: its source rule, else the catch-all."""
    table = {}
    for dst in range(network.count):
        rules = netem.show(network.switch_port(dst), netns=network.lab.switch)
        for src in range(network.count):
            if src != dst:
                table[(src, dst)] = rules.get(network.hosts[src], rules[None])
    return table


def every_link(loss: str) -> dict[tuple[int, int], LinkProfile]:
    profile = LinkProfile.parse(loss=loss)
    return {(s, d): profile for s in range(WORKERS) for d in range(WORKERS) if s != d}


def test_sixteen_workers_every_pair_has_its_rule_and_changes_land():
    with ClusterNetwork(scenario(announced=True), backend="fallback") as network:
        assert len(set(lab_namespaces(network.prefix))) == WORKERS + 1
        for dst in range(WORKERS):
            rules = netem.show(network.switch_port(dst), netns=network.lab.switch)
            # Each peer's rule holds its IPv4 and its IPv6 address (docs/shaping.md).
            peers = {address for s in range(WORKERS) if s != dst
                     for address in network.lab.addresses(s)}
            assert set(rules) == {None, network.control_address} | peers
            assert rules[network.control_address] == LinkProfile()  # the run's own: unshaped
        assert kernel_table(network) == every_link("1%")

        network.set_links(every_link("3%"))
        assert kernel_table(network) == every_link("3%")

        network.set_link(0, 1, LinkProfile.parse(loss="7%"))
        assert kernel_table(network) == every_link("3%") | {(0, 1): LinkProfile.parse(loss="7%")}
    assert lab_namespaces(network.prefix) == []


def test_new_source_rules_on_many_lossy_receivers_at_once():
    """Receivers that get source rules later are rebuilt while the shared nft table must stay:
    all but one together, then the last one."""
    with ClusterNetwork(scenario(announced=False), backend="fallback") as network:
        changes = {(0, dst): LinkProfile.parse(loss="9%") for dst in range(1, WORKERS)}
        network.set_links(changes)
        assert kernel_table(network) == every_link("1%") | changes
        network.partition([(1, 0), (2, 0)])
        assert kernel_table(network) == (every_link("1%") | changes
                                         | {(1, 0): CUT,
                                            (2, 0): CUT})
        network.heal()
        assert kernel_table(network) == every_link("1%") | changes
    assert lab_namespaces(network.prefix) == []
