"""The Compose projects `testbed compose` writes: one per shipped scenario, in step with it,
with the settings the workers need and nothing more (no privileged containers, ports on
loopback only); and a node's view of the links into it (`IngressLinks`), without a kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from netem.profile import LinkProfile
from testbed.cluster.node import KEY_FILE, IngressLinks, preempting
from testbed.compose import (
    FILE,
    KEY_COPY,
    PROMETHEUS_CONFIG,
    SCENARIO_COPY,
    ComposeError,
    check_compose,
    worker_addresses,
    write_project,
)
from testbed.scenario import load_scenario, scenario_files
from testbed.scenario.links import CUT
from testbed.transport.auth import read_key


@pytest.mark.parametrize("path", scenario_files(), ids=lambda path: path.stem)
def test_every_shipped_scenario_makes_a_project_in_step_with_it(path: Path, tmp_path: Path):
    written = write_project(path, tmp_path)
    scenario = load_scenario(path)
    project = yaml.safe_load(written.read_text())
    workers = {name: service for name, service in project["services"].items()
               if name.startswith("worker-")}
    assert sorted(workers) == sorted(f"worker-{r}" for r in range(scenario.count))
    restarted = {rank for rank, events in preempting(scenario).items()
                 if any(event.action == "restart" for event in events)}
    hosts = worker_addresses(scenario.count)
    for rank in range(scenario.count):
        service = workers[f"worker-{rank}"]
        assert service["cap_add"] == ["NET_ADMIN"] and "privileged" not in service
        assert service["init"] is True
        assert service["restart"] == ("on-failure" if rank in restarted else "no")
        assert service["networks"]["testbed"]["ipv4_address"] == hosts[rank]
        assert service["command"][service["command"].index("--hosts") + 1] == ",".join(hosts)
        mounted = f"./{KEY_COPY}:{KEY_FILE}:ro" in service["volumes"]
        assert mounted == scenario.authenticates("compose")
    for service in project["services"].values():
        assert all(port.startswith("127.0.0.1:") for port in service.get("ports", []))
    targets = yaml.safe_load((tmp_path / PROMETHEUS_CONFIG).read_text())
    scraped = targets["scrape_configs"][0]["static_configs"]
    assert [group["labels"]["worker"] for group in scraped] == [
        str(r) for r in range(scenario.count)]
    assert (tmp_path / SCENARIO_COPY).read_text() == path.read_text()
    assert (tmp_path / KEY_COPY).exists() == scenario.authenticates("compose")
    assert check_compose(tmp_path) == []


def test_each_project_of_an_authenticating_scenario_has_a_new_secret_only_its_owner_reads(
        tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 2\njob: {model: mlp, steps: 10}\n"
                    "collective: {kind: lossy}\n")
    out = tmp_path / "out"
    write_project(path, out)
    first = read_key(out / KEY_COPY)  # refuses a file others may read
    write_project(path, out)
    assert read_key(out / KEY_COPY) != first
    (out / KEY_COPY).unlink()
    assert check_compose(out) == [KEY_COPY]
    path.write_text(path.read_text() + "security: {authenticate: false}\n")
    write_project(path, out)
    project = yaml.safe_load((out / FILE).read_text())
    assert not (out / KEY_COPY).exists() and check_compose(out) == []
    assert all(KEY_COPY not in " ".join(service.get("volumes", []))
               for service in project["services"].values())


def test_a_project_out_of_step_with_its_scenario_is_found(tmp_path: Path):
    write_project(scenario_files()[0], tmp_path)
    copy = tmp_path / SCENARIO_COPY
    text = copy.read_text()
    assert "workers: 4" in text
    copy.write_text(text.replace("workers: 4", "workers: 3"))
    assert check_compose(tmp_path) == [FILE, PROMETHEUS_CONFIG]


def test_a_scenario_preempting_worker_0_is_refused_naming_the_timeline(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 3\njob: {model: mlp, steps: 10}\n"
                    "timeline:\n  - {step: 5, kill: 0}\n")
    with pytest.raises(ComposeError, match="timeline: worker 0"):
        write_project(path, tmp_path / "out")


def test_a_node_shapes_only_links_into_it_and_cuts_and_heals_them():
    scenario = load_scenario(scenario_files()[0])
    hosts = worker_addresses(scenario.count)
    links = IngressLinks(scenario, 1, hosts, "eth0")
    before = links.rules()
    assert set(before) == {None, hosts[0], hosts[2], hosts[3]}
    assert before[hosts[0]] == scenario.link_profile(0, 1)

    lossy = LinkProfile(loss=0.3)
    assert links.set_links({(0, 1): lossy, (1, 2): lossy}) == 0.0  # not started: no kernel
    assert links.rules()[hosts[0]] == lossy
    assert links.links.current(1, 2) == lossy  # remembered for the timeline, shaped by worker 2
    links.partition([(2, 1), (1, 3)])
    assert links.rules()[hosts[2]] == CUT and links.rules()[hosts[3]] != CUT
    links.heal([(2, 1)])
    assert links.rules()[hosts[2]] == scenario.link_profile(2, 1)
