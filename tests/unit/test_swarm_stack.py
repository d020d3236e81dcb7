"""The Docker Swarm stacks `testbed compose --swarm` writes: one per shipped scenario, with what
Swarm honours (and nothing it ignores or refuses), the restart policy and placement the
scenario asks for, and every file a node needs travelling as a config or a secret; and a
node's side of it without a swarm: names resolved to one address each, and a peer that came
back at another address followed by its ingress rule and its collective."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from testbed.cluster.node import (
    ADDRESS_KEY,
    AUTO_IFACE,
    KEY_FILE,
    POSTED_KEY,
    Node,
    preempting,
    resolve_hosts,
    service_name,
)
from testbed.compose import KEY_COPY, PROMETHEUS_CONFIG, SCENARIO_COPY, ComposeError
from testbed.compose.swarm import (
    MONITORING_FILE,
    OVERLAY_MTU,
    STACK_FILE,
    constraints,
    node_labels,
    stack_name,
    write_stack,
)
from testbed.scenario import find_scenario, load_scenario, scenario_files

# What `docker stack deploy` ignores or refuses (Compose-only keys), per service.
COMPOSE_ONLY = {"build", "container_name", "depends_on", "restart", "profiles", "links",
                "network_mode", "ipv4_address", "healthcheck"}
OBJECT_NAME = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
SWARM_NAME_LIMIT = 64  # characters of a config's or secret's name (stack prefix included)


@pytest.mark.parametrize("path", scenario_files(), ids=lambda path: path.stem)
def test_every_shipped_scenario_makes_a_stack_swarm_can_deploy(path: Path, tmp_path: Path):
    stack_path, monitoring_path = write_stack(path, tmp_path)
    assert (stack_path.name, monitoring_path.name) == (STACK_FILE, MONITORING_FILE)
    scenario = load_scenario(path)
    stack = yaml.safe_load(stack_path.read_text())
    monitoring = yaml.safe_load(monitoring_path.read_text())
    assert stack["version"] == monitoring["version"] == "3.8"
    names = [service_name(rank) for rank in range(scenario.count)]
    assert list(stack["services"]) == names
    for rank, name in enumerate(names):
        service = stack["services"][name]
        assert not COMPOSE_ONLY & set(service), service
        assert service["image"] == "${WORKER_IMAGE:-testbed-worker:latest}"
        command = service["command"]
        assert command[command.index("--hosts") + 1] == ",".join(names)
        assert command[command.index("--iface") + 1] == AUTO_IFACE
        assert command[command.index("--rank") + 1] == str(rank)
        assert service["cap_add"] == ["NET_ADMIN"] and service["init"] is True
        assert service["labels"] == {"testbed.scenario": scenario.name,
                                     "testbed.rank": str(rank)}
        deploy = service["deploy"]
        assert deploy["endpoint_mode"] == "dnsrr" and deploy["replicas"] == 1
        restarts = sum(e.action == "restart" for e in preempting(scenario).get(rank, []))
        assert deploy["restart_policy"] == (
            {"condition": "on-failure", "delay": "0s", "max_attempts": restarts} if restarts
            else {"condition": "none"})
        assert deploy.get("placement", {}).get("constraints", []) == constraints(
            scenario, rank, "groups")
        scenario_config, *data_configs = service["configs"]
        assert scenario_config["target"] == f"/scenario/{SCENARIO_COPY}"
        assert scenario_config["mode"] == 0o444
        assert stack["configs"][scenario_config["source"]] == {"file": f"./{SCENARIO_COPY}"}
        # The scenario's data files (traces) beside it, as configs too.
        traces = {f"/scenario/{Path(trace.file).relative_to(path.parent.resolve())}"
                  for trace in scenario.traces().values()}
        assert {config["target"] for config in data_configs} == traces
        if scenario.authenticates("compose"):
            (secret,) = service["secrets"]
            assert Path("/run/secrets") / secret["target"] == KEY_FILE
            assert secret["mode"] == 0o400
            assert stack["secrets"][secret["source"]] == {"file": f"./{KEY_COPY}"}
        else:
            assert "secrets" not in service and "secrets" not in stack
        assert service["volumes"][0] == {"type": "bind", "source": "./runs", "target": "/runs"}
        assert service["networks"] == ["testbed"]
    # Both files declare the same overlay (each deploys on its own, or merged with the other).
    network = {"driver": "overlay", "attachable": True,
               "driver_opts": {"com.docker.network.driver.mtu": str(
                   min(scenario.topology.mtu, OVERLAY_MTU))}}
    assert stack["networks"] == monitoring["networks"] == {"testbed": network}
    # Every config and secret: a file beside the stack, a name Swarm takes with its stack's.
    objects = {**stack["configs"], **stack.get("secrets", {}), **monitoring["configs"]}
    for key, spec in objects.items():
        assert (tmp_path / spec["file"]).is_file(), spec
        scoped = f"{stack_name(scenario)}_{key}"
        assert OBJECT_NAME.match(scoped) and len(scoped) <= SWARM_NAME_LIMIT, scoped
    # Monitoring: Prometheus and Grafana on a manager, ports on that node, no volume left.
    services = monitoring["services"]
    assert set(services) == {"prometheus", "grafana"}
    for service in services.values():
        assert not COMPOSE_ONLY - {"healthcheck"} & set(service), service
        assert service["deploy"] == {"placement": {"constraints": ["node.role == manager"]}}
        assert all(port["mode"] == "host" for port in service["ports"])
    prometheus = services["prometheus"]
    assert {"type": "tmpfs", "target": "/prometheus"} in prometheus["volumes"]
    assert {"type": "bind", "source": "./runs", "target": "/runs",
            "read_only": True} in prometheus["volumes"]
    assert prometheus["configs"][0]["target"] == f"/etc/prometheus/{PROMETHEUS_CONFIG}"
    targets = {config["target"] for config in services["grafana"]["configs"]}
    assert "/etc/grafana/provisioning/datasources/prometheus.yaml" in targets
    assert "/var/lib/grafana/dashboards/overview.json" in targets
    assert "volumes" not in monitoring  # nothing that `docker stack rm` would leave


def test_two_regions_puts_each_region_on_the_nodes_labelled_for_it(tmp_path: Path):
    path = find_scenario("two-regions")
    scenario = load_scenario(path)
    assert node_labels(scenario, "groups") == {"testbed.group.east": [0, 1, 2, 3],
                                               "testbed.group.west": [4, 5, 6, 7]}
    assert node_labels(scenario, "workers") == {f"testbed.worker.{r}": [r] for r in range(8)}
    assert node_labels(scenario, "none") == {}
    stack_path, _ = write_stack(path, tmp_path, place="workers")
    service = yaml.safe_load(stack_path.read_text())["services"]["worker-5"]
    assert service["deploy"]["placement"] == {"constraints": ["node.labels.testbed.worker.5 == "
                                                              "true"]}
    stack_path, _ = write_stack(path, tmp_path, place="none")
    assert "placement" not in yaml.safe_load(stack_path.read_text())["services"]["worker-5"][
        "deploy"]
    # A worker in no group runs anywhere.
    assert node_labels(load_scenario(find_scenario("quickstart")), "groups") == {}
    with pytest.raises(ComposeError, match="place: expected one of groups, workers, none"):
        constraints(scenario, 0, "regions")  # type: ignore[arg-type]


def test_a_regenerated_stack_names_changed_files_anew_so_it_deploys_over_a_running_one(
        tmp_path: Path):
    """Swarm cannot change a config or a secret in place: each is named by its content, so a
    new run's key is a new secret, while an unchanged scenario keeps its config's name."""
    path = find_scenario("quickstart")
    first = yaml.safe_load(write_stack(path, tmp_path)[0].read_text())
    second = yaml.safe_load(write_stack(path, tmp_path)[0].read_text())
    assert first["configs"] == second["configs"]
    assert set(first["secrets"]).isdisjoint(second["secrets"])


def test_the_run_directory_and_monitoring_options(tmp_path: Path):
    path = find_scenario("quickstart")
    stack_path, monitoring_path = write_stack(path, tmp_path, runs=Path("/srv/testbed/runs"),
                                              grafana=False, subnet="10.77.0.0/24", steps=5)
    stack = yaml.safe_load(stack_path.read_text())
    monitoring = yaml.safe_load(monitoring_path.read_text())
    worker = stack["services"]["worker-0"]
    assert worker["volumes"] == [{"type": "bind", "source": "/srv/testbed/runs",
                                  "target": "/runs"}]
    assert worker["command"][worker["command"].index("--steps") + 1] == "5"
    assert list(monitoring["services"]) == ["prometheus"]
    assert all(not key.startswith("grafana") for key in monitoring["configs"])
    assert stack["networks"]["testbed"]["ipam"] == {"config": [{"subnet": "10.77.0.0/24"}]}
    with pytest.raises(ComposeError, match="runs: a path every node has, absolute"):
        write_stack(path, tmp_path, runs=Path("runs"))


def test_a_scenario_preempting_worker_0_is_refused_under_swarm_too(tmp_path: Path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 3\njob: {model: mlp, steps: 10}\n"
                    "timeline:\n  - {step: 5, kill: 0}\n")
    with pytest.raises(ComposeError, match="timeline: worker 0"):
        write_stack(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_names_resolve_to_one_address_each_and_a_workers_own_to_its_local_one():
    names = {"worker-1": {"10.0.1.3"}, "worker-0": {"10.0.1.9", "10.0.1.2"}}
    asked: set[str] = set()

    def lookup(name: str) -> set[str]:
        """Each name appears on its second look, as Swarm starts the tasks."""
        first = name not in asked
        asked.add(name)
        return set() if first else set(names.get(name, ()))

    def local() -> dict[str, tuple[str, int]]:
        return {"10.0.1.2": ("eth1", 1450), "127.0.0.1": ("lo", 65536)}

    # Worker 0's own name still lists its previous task's address: its own is local.
    assert resolve_hosts(["worker-0", "worker-1", "10.0.9.9"], 0, lookup=lookup,
                         local=local) == ["10.0.1.2", "10.0.1.3", "10.0.9.9"]
    # A peer's name listing two tasks' addresses is not taken: the error names it.
    names["worker-1"] = {"10.0.1.3", "10.0.1.7"}
    with pytest.raises(ValueError, match=r"--hosts: .* worker-1 \(10.0.1.3, 10.0.1.7\)"):
        resolve_hosts(["worker-0", "worker-1"], 0, lookup=lookup, local=local, wait=0)
    with pytest.raises(ValueError, match=r"worker-2 \(no address\)"):
        resolve_hosts(["worker-0", "worker-2"], 0, lookup=lookup, local=local, wait=0)


class Store:
    """The calls a node makes on the run's TCPStore to follow its peers' addresses."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value


class Worker:
    def __init__(self) -> None:
        self.moved: list[tuple[int, str]] = []

    def peer_moved(self, rank: int, host: str) -> None:
        self.moved.append((rank, host))


def test_a_peer_back_at_another_address_is_followed_by_its_rule_and_collective(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 3\njob: {model: mlp, steps: 10}\n"
                    "collective: {kind: lossy}\nsecurity: {authenticate: false}\n"
                    "topology: {default: {loss: 1%}}\n"
                    "timeline:\n  - {step: 3, kill: 2}\n  - {step: 5, restart: 2}\n")
    node = Node(path, 1, ["worker-0", "worker-1", "worker-2"], tmp_path, iface=AUTO_IFACE)
    assert node.named
    resolved = ["10.0.1.2", "10.0.1.3", "10.0.1.4"]
    node.hosts, node.network.hosts = list(resolved), list(resolved)
    store, worker = Store(), Worker()
    node._client, node._worker = store, worker
    for rank, host in enumerate(resolved):  # each node posts its address as it starts
        store.set(ADDRESS_KEY.format(rank), host)
        store.add(POSTED_KEY, 1)
    node._before_step(0)
    assert worker.moved == [] and node.hosts == resolved
    store.set(ADDRESS_KEY.format(2), "10.0.1.9")  # worker 2's new task
    store.add(POSTED_KEY, 1)
    node._before_step(6)
    assert worker.moved == [(2, "10.0.1.9")]
    assert node.hosts == node.network.hosts == ["10.0.1.2", "10.0.1.3", "10.0.1.9"]
    assert node.network.rules()["10.0.1.9"] == node.scenario.link_profile(2, 1)
    assert "10.0.1.4" not in node.network.rules()
    node._before_step(7)  # nothing posted since: nothing read again
    assert worker.moved == [(2, "10.0.1.9")]
    # Worker 0 lists the workers for Prometheus by name: a moved one is found where it is.
    node._write_targets("s-1")
    assert "worker-2:9100" in (tmp_path / "prometheus-targets.json").read_text()


def test_the_command_line_writes_the_stack_and_says_how_to_label_deploy_and_end_it(tmp_path):
    from typer.testing import CliRunner

    from testbed.cli import app

    out = tmp_path / "stack"
    result = CliRunner().invoke(app, ["compose", "two-regions", "--swarm", "-o", str(out),
                                      "--no-grafana"])
    assert result.exit_code == 0, result.output
    assert "docker node update --label-add testbed.group.east=true NODE" in result.output
    assert (f"docker stack deploy --resolve-image never -c {out / STACK_FILE} -c "
            f"{out / MONITORING_FILE} testbed-two-regions") in result.output
    assert "docker stack rm testbed-two-regions" in result.output
    for wrong, message in ((["--place", "racks"], "--place: expected one of groups"),
                           (["--up"], "--up, --keep: for a Compose project"),
                           (["--subnet", "10.0.0.300/24"], "--subnet: "),
                           (["--runs", "relative"], "runs: a path every node has")):
        result = CliRunner().invoke(app, ["compose", "quickstart", "--swarm", "-o",
                                          str(tmp_path / "other"), *wrong])
        assert result.exit_code == 2 and message in result.output, (wrong, result.output)
