"""The Compose projects `testbed compose` writes: one per shipped scenario, in step with it,
with the settings the workers need and nothing more (no privileged containers, ports on
loopback only); and a node's view of the links into it (`IngressLinks`, and what it gives the
kernel: each link's seed), without a kernel."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from netem.profile import LinkProfile, derive_seed
from testbed.cluster.node import KEY_FILE, IngressLinks, Node, preempting, service_name
from testbed.cluster.relay import TARGETS_FILE
from testbed.cluster.worker import PORTS
from testbed.compose import (
    FILE,
    KEY_COPY,
    MONITORING,
    PROMETHEUS_CONFIG,
    ROOT,
    SCENARIO_COPY,
    ComposeError,
    check_compose,
    default_directory,
    worker_addresses,
    write_project,
)
from testbed.scenario import find_scenario, load_scenario, scenario_files
from testbed.scenario.links import CUT
from testbed.transport.auth import read_key


@pytest.mark.parametrize("path", scenario_files(), ids=lambda path: path.stem)
def test_every_shipped_scenario_makes_a_portable_project_in_step_with_it(path: Path,
                                                                        tmp_path: Path):
    written = write_project(path, tmp_path)
    scenario = load_scenario(path)
    text = written.read_text()
    project = yaml.safe_load(text)
    workers = {name: service for name, service in project["services"].items()
               if name.startswith("worker-")}
    assert sorted(workers) == sorted(service_name(r) for r in range(scenario.count))
    restarted = {rank for rank, events in preempting(scenario).items()
                 if any(event.action == "restart" for event in events)}
    hosts = worker_addresses(scenario.count)
    for rank in range(scenario.count):
        service = workers[service_name(rank)]
        assert service["cap_add"] == ["NET_ADMIN"] and "privileged" not in service
        assert service["init"] is True
        assert service["restart"] == ("on-failure" if rank in restarted else "no")
        assert service["networks"]["testbed"]["ipv4_address"] == hosts[rank]
        assert service["command"][service["command"].index("--hosts") + 1] == ",".join(hosts)
        assert service["healthcheck"]["test"][:2] == ["CMD", "python"]
        assert "/metrics" in service["healthcheck"]["test"][-1]
        assert service.get("depends_on") == (
            None if rank == 0 else {"worker-0": {"condition": "service_started"}})
        mounted = f"./{KEY_COPY}:{KEY_FILE}:ro" in service["volumes"]
        assert mounted == scenario.authenticates("compose")
    # Written once, referred to by every other worker.
    assert text.count("build: &worker-build") == 1
    assert text.count("build: *worker-build") == scenario.count - 1
    assert text.count("healthcheck: *worker-healthcheck") == scenario.count - 1
    # Portable: every host path is relative to the project; the build context reaches the
    # checkout from it, and the dashboards are beside the file.
    assert not os.path.isabs(workers["worker-0"]["build"]["context"])
    assert str(tmp_path) not in text
    services = project["services"]
    host_paths = [volume.split(":")[0] for service in services.values()
                  for volume in service.get("volumes", [])]
    assert all(p.startswith("./") or p == "prometheus-data" for p in host_paths), host_paths
    context = tmp_path / workers["worker-0"]["build"]["context"]
    assert (context / "compose" / "Dockerfile").exists()
    for volume in services["grafana"]["volumes"]:
        assert (tmp_path / volume.split(":")[0]).is_dir(), volume
    # Monitoring: a profile of its own, Prometheus' data in a named volume, Grafana once
    # Prometheus is ready; published ports on loopback only.
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == [MONITORING]
    assert "prometheus-data:/prometheus" in services["prometheus"]["volumes"]
    assert project["volumes"] == {"prometheus-data": {}}
    assert "/-/ready" in services["prometheus"]["healthcheck"]["test"][-1]
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    for service in services.values():
        assert all(port.startswith("127.0.0.1:") for port in service.get("ports", []))
    config = yaml.safe_load((tmp_path / PROMETHEUS_CONFIG).read_text())
    (scrape,) = config["scrape_configs"]
    assert scrape["file_sd_configs"] == [{"files": [f"/runs/{TARGETS_FILE}"],
                                          "refresh_interval": "2s"}]
    assert (tmp_path / SCENARIO_COPY).read_text() == path.read_text()
    assert (tmp_path / KEY_COPY).exists() == scenario.authenticates("compose")
    assert check_compose(tmp_path) == []


def test_the_default_project_reaches_the_checkout_by_a_path_that_moves_with_it():
    scenario = load_scenario(scenario_files()[0])
    out = default_directory(scenario)
    assert out.is_relative_to(ROOT / "build")
    written = write_project(scenario_files()[0], out)
    assert str(ROOT) not in written.read_text()
    build = yaml.safe_load(written.read_text())["services"]["worker-0"]["build"]
    assert build["context"] == "../../.."


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
    assert check_compose(tmp_path) == [FILE]


def test_worker_0_lists_each_runs_targets_for_prometheus(tmp_path: Path):
    """Each run gets its own `run` label: worker 0 replaces the project's file_sd document when
    it starts a run; a command job's own metrics port is listed beside the testbed's."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nworkers: 2\njob:\n  command: [python, t.py]\n"
                        "  metrics_port: 8000\n")
    hosts = worker_addresses(2)
    node = Node(scenario, 0, hosts, tmp_path)
    for run in ("s-20261126-010000", "s-20261126-020000"):
        node._write_targets(run)
        groups = json.loads((tmp_path / TARGETS_FILE).read_text())
        assert groups == [
            {"targets": [f"{host}:{port}"],
             "labels": {"scenario": "s", "run": run, "source": source, "worker": str(rank)}}
            for source, port in (("testbed", PORTS["metrics"]), ("program", 8000))
            for rank, host in enumerate(hosts)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s.yaml", TARGETS_FILE])


def test_a_scenario_preempting_worker_0_is_refused_naming_the_timeline(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 3\njob: {model: mlp, steps: 10}\n"
                    "timeline:\n  - {step: 5, kill: 0}\n")
    with pytest.raises(ComposeError, match="timeline: worker 0"):
        write_project(path, tmp_path / "out")


@pytest.mark.parametrize(("cwd", "words"), [
    ("/srv/job", "job.cwd: expected a directory relative to the scenario file's, got the "
                 "absolute path '/srv/job'"),
    ("sub/../..", "job.cwd: expected a directory inside the scenario file's, got 'sub/../..'"),
])
def test_a_command_jobs_cwd_outside_the_scenarios_directory_is_refused(tmp_path: Path, cwd,
                                                                      words):
    """A Compose worker has only the scenario's directory; a run in namespaces takes any cwd."""
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nworkers: 2\njob: {{command: [python, t.py], cwd: '{cwd}'}}\n")
    load_scenario(path)
    with pytest.raises(ComposeError, match=re.escape(words)):
        write_project(path, tmp_path / "out")


TRACED = """name: traced
workers: 2
topology:
  links:
    - {{between: [0, 1], trace: {{file: {trace}}},
       profile: {{delay: 10ms, jitter: 2ms, distribution: {{samples: {samples}, unit: ms}}}}}}
job: {{model: mlp, steps: 10}}
"""


def test_a_scenarios_data_files_are_copied_beside_its_copy_and_mounted_there(tmp_path: Path):
    """A trace and a delay-samples file under the scenario's directory: each is copied to its
    place beside the scenario's copy, mounted beside it in every worker, and a Swarm stack
    carries each as a config; the project is in step with its scenario."""
    from testbed.compose.swarm import write_stack

    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "cell.csv").write_text("time,rate\n0,10mbit\n1s,2mbit\n2s,\n")
    (tmp_path / "delays.txt").write_text("\n".join(str(10 + i % 7) for i in range(200)))
    path = tmp_path / "traced.yaml"
    path.write_text(TRACED.format(samples="delays.txt",
                                  trace="traces/cell.csv"))
    out = tmp_path / "out"
    project = yaml.safe_load(write_project(path, out).read_text())
    for name in ("traces/cell.csv", "delays.txt"):
        assert (out / name).read_text() == (tmp_path / name).read_text()
        for rank in range(2):
            assert f"./{name}:/scenario/{name}:ro" in project["services"][
                service_name(rank)]["volumes"]
    assert check_compose(out) == []
    stack, _ = write_stack(path, tmp_path / "swarm")
    services = yaml.safe_load(stack.read_text())["services"]
    targets = {config["target"] for config in services[service_name(1)]["configs"]}
    assert targets == {f"/scenario/{SCENARIO_COPY}", "/scenario/traces/cell.csv",
                       "/scenario/delays.txt"}


def test_a_data_file_outside_the_scenarios_directory_is_refused(tmp_path: Path):
    (tmp_path / "cell.csv").write_text("time,rate\n0,10mbit\n1s,\n")
    (tmp_path / "delays.txt").write_text("\n".join(str(10 + i % 7) for i in range(200)))
    (tmp_path / "scenarios").mkdir()
    path = tmp_path / "scenarios" / "traced.yaml"
    path.write_text(TRACED.format(samples="../delays.txt",
                                  trace="../cell.csv"))
    load_scenario(path)  # fine where it runs in namespaces
    with pytest.raises(ComposeError, match=r"topology\.links\[0\]\.(profile\.distribution\.samples|"
                                           r"trace\.file): .* is outside the scenario's directory"):
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


def test_a_node_gives_the_kernel_each_links_seed(monkeypatch: pytest.MonkeyPatch):
    scenario = load_scenario(find_scenario("loss-5"))
    hosts = worker_addresses(scenario.count)
    given: list[dict] = []
    monkeypatch.setattr("netem.apply", lambda iface, rules, **_: given.append(rules))
    monkeypatch.setattr("netem.change", lambda iface, rules, **_: given.append(rules))
    links = IngressLinks(scenario, 1, hosts, "eth0")
    for change in (links.start, lambda: links.set_link(2, 1, LinkProfile(loss=0.3)),
                   lambda: links.move(3, "10.0.1.9")):
        change()
        seeds = {host: derive_seed(scenario.seed, src, 1)
                 for src, host in enumerate(links.hosts) if src != 1}
        expected = {host: links.rules()[host].model_copy(update={"seed": seed})
                    for host, seed in seeds.items()}
        assert given.pop() == {None: LinkProfile(), **expected}
    assert expected[hosts[2]].loss == 0.3 and "10.0.1.9" in expected


def test_a_command_job_gets_its_working_directory_mounted_not_the_scenarios(tmp_path: Path):
    (tmp_path / "job" / "src").mkdir(parents=True)
    (tmp_path / "secrets.txt").write_text("not for the containers")
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 2\njob: {command: [python, train.py], cwd: job/src}\n")
    out = tmp_path / "out"
    project = yaml.safe_load(write_project(path, out).read_text())
    worker = project["services"]["worker-0"]
    assert "../job/src:/job/job/src:ro" in worker["volumes"]
    assert not any(volume.startswith("..:") for volume in worker["volumes"])
    assert worker["command"][worker["command"].index("--base-dir") + 1] == "/job"
    assert check_compose(out) == []


def test_a_project_is_written_only_where_nothing_of_the_users_would_be_overwritten(
        tmp_path: Path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / SCENARIO_COPY).write_text("name: my own notes\n")
    with pytest.raises(ComposeError, match=r"holds files of its own \(scenario\.yaml\)"):
        write_project(scenario_files()[0], out)
    assert (out / SCENARIO_COPY).read_text() == "name: my own notes\n"
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ComposeError, match="is a file"):
        write_project(scenario_files()[0], afile)
    written = tmp_path / "written"
    for _ in range(2):  # a project written before is written again
        write_project(scenario_files()[0], written)
