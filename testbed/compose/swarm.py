"""A Docker Swarm stack for a scenario: `testbed compose SCENARIO --swarm` writes it, and
`docker stack deploy` runs it on one machine or many (docs/multi-host.md).

The workers are the Compose project's (`testbed.compose.project` gives both placements the
worker command, labels, Prometheus and Grafana, Prometheus's configuration and the files
beside the project); what Swarm needs differently is here:

- One service per worker, one replica, `endpoint_mode: dnsrr`: the service's name resolves to
  its task's own address (a VIP would load-balance through IPVS and hide the sender, which
  per-peer shaping and the transport's source check key on). Swarm gives no fixed addresses,
  so `--hosts` names the services and each node resolves them (`testbed.cluster.node`), and
  shapes the interface that holds its own address (`--iface auto`).
- The restart policy is the timeline's: `on-failure` (no delay, as many attempts as the
  timeline restarts the worker) for the workers it restarts, `none` for the others. A `kill`
  ends the worker's process; Swarm starts a new task, maybe elsewhere, at a new address.
- Placement: each worker in a group of `topology.groups` (its first) runs only on nodes
  labelled `testbed.group.<group>=true` (`place="groups"`), or each worker on nodes labelled
  `testbed.worker.<rank>=true` (`place="workers"`), or anywhere (`place="none"`).
- What must reach every node travels through the swarm itself: the scenario's copy and
  Prometheus's and Grafana's files as configs, the run's key as a secret (mounted at
  `node.KEY_FILE`). Each is named by a digest of its content, so a regenerated project
  deploys over a running stack (a config or secret cannot change in place). The run
  directory is a bind mount (`runs`: by default the stack's `runs/`, which the docker command
  line resolves on the machine that deploys; across machines, a path every node mounts).
- The overlay network is attachable, with an MTU of at most 1450 (VXLAN takes 50 bytes of a
  1500-byte frame); a worker sizes its datagrams for its interface where that is below the
  scenario's MTU.
- The workers have no healthcheck: under Swarm a task's name resolves only once it is
  healthy, and the workers resolve each other's names before they serve their metrics (a
  deadlock), and a task found unhealthy is replaced (a preemption the timeline never asked
  for). Prometheus keeps its readiness check.
- GPUs: a command job's `gpus` is refused. Swarm does not take Compose's device
  reservations, and its generic resources are what each node's daemon declares by hand.
- Monitoring is a second stack file (`docker stack deploy` knows no profiles): Prometheus
  and Grafana, on a manager, their ports published on that node (Swarm cannot publish on
  127.0.0.1 only), Prometheus's data in a tmpfs.

A stack cannot build: its images are used by name (`WORKER_IMAGE`, `PROMETHEUS_IMAGE`,
`GRAFANA_IMAGE`), present on every node (scripts/compose-images.sh) or in a registry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from testbed.cluster.node import AUTO_IFACE, KEY_FILE, preempting, service_name
from testbed.compose.project import (
    GRAFANA_DASHBOARDS,
    GRAFANA_PORT,
    KEY_COPY,
    MONITORING_FILE,
    PROMETHEUS_CONFIG,
    PROMETHEUS_PORT,
    ROOT,
    SCENARIO_COPY,
    STACK_FILE,
    WORKER_IMAGE,
    ComposeError,
    check_scenario,
    data_files,
    dump,
    grafana_service,
    job_directory,
    project_name,
    prometheus_service,
    worker_command,
    worker_labels,
    write_files,
)
from testbed.compose.project import default_directory as compose_directory
from testbed.scenario.model import Scenario

VERSION = "3.8"
OVERLAY_MTU = 1450  # a 1500-byte underlay less VXLAN's 50 bytes: Docker's default
Place = Literal["groups", "workers", "none"]
PLACES: tuple[Place, ...] = ("groups", "workers", "none")
DIGEST = 10  # hex digits of a config's or secret's content digest in its name
READ_ONLY, OWNER_ONLY = 0o444, 0o400  # file modes of configs and of the run's key
MANAGER = "node.role == manager"
NETWORK = "testbed"


def stack_name(scenario: Scenario) -> str:
    """The name to deploy the stack under (`docker stack deploy ... NAME`)."""
    return f"testbed-{project_name(scenario.name)}"


def group_label(group: str) -> str:
    return f"testbed.group.{group}"


def worker_label(rank: int) -> str:
    return f"testbed.worker.{rank}"


def constraints(scenario: Scenario, rank: int, place: Place) -> list[str]:
    """Where worker `rank` may run: on nodes carrying its group's label or its own, or
    anywhere."""
    if place not in PLACES:
        raise ComposeError(f"place: expected one of {', '.join(PLACES)}, got {place!r}")
    group = scenario.group(rank) if place == "groups" else None
    label = (group_label(group) if group is not None
             else worker_label(rank) if place == "workers" else None)
    return [] if label is None else [f"node.labels.{label} == true"]


def node_labels(scenario: Scenario, place: Place) -> dict[str, list[int]]:
    """Each node label the stack's constraints ask for, with the workers that need it."""
    needed: dict[str, list[int]] = {}
    for rank in range(scenario.count):
        for constraint in constraints(scenario, rank, place):
            label = constraint.removeprefix("node.labels.").split(" ")[0]
            needed.setdefault(label, []).append(rank)
    return needed


def restart_policy(scenario: Scenario, rank: int) -> dict[str, Any]:
    """The timeline's restarts of worker `rank` as Swarm's policy: a new task at once after
    each failure, as many times as the timeline restarts it; none for the others (an end by a
    `kill` without restart, or a failure, stays an end)."""
    restarts = sum(event.action == "restart" for event in preempting(scenario).get(rank, []))
    if not restarts:
        return {"condition": "none"}
    return {"condition": "on-failure", "delay": "0s", "max_attempts": restarts}


def _digest_name(kind: str, path: Path) -> str:
    """A config's or secret's key in the stack: what it is and a digest of its content."""
    return f"{kind}-{hashlib.sha256(path.read_bytes()).hexdigest()[:DIGEST]}"


def _bind(source: str, target: str, *, read_only: bool = False) -> dict[str, Any]:
    return {"type": "bind", "source": source, "target": target,
            **({"read_only": True} if read_only else {})}


def _network(scenario: Scenario, subnet: str | None) -> dict[str, Any]:
    """The overlay every service is on (attachable: a probe or a debugging container can
    join it), its MTU within VXLAN's, its subnet Swarm's choice unless given."""
    mtu = min(scenario.topology.mtu, OVERLAY_MTU)
    return {NETWORK: {"driver": "overlay", "attachable": True,
                      "driver_opts": {"com.docker.network.driver.mtu": str(mtu)},
                      **({"ipam": {"config": [{"subnet": subnet}]}} if subnet else {})}}


def swarm_stack(scenario: Scenario, directory: Path, *, steps: int | None = None,
                place: Place = "groups", runs: str = "./runs", job_files: str | None = None,
                subnet: str | None = None, data: Sequence[str] = ()) -> dict[str, Any]:
    """The workers' stack (as a dict) for `scenario`, whose files (`write_files`) are in
    `directory`: the configs and the secret are named by their content there; `data`: the
    scenario's data files there (`data_files`), each a config beside the scenario's. `runs`:
    the run directory's host path (relative: to the stack file); `job_files`: a command job's
    directory, relative to `directory`, bound read-only at /job; `subnet`: the overlay's
    (None: Swarm's choice)."""
    check_scenario(scenario)
    if scenario.command is not None and scenario.command.gpus is not None:
        raise ComposeError("job.gpus: a Swarm stack cannot reserve GPUs (docker stack deploy "
                           "ignores Compose's device reservations; Swarm has only generic "
                           "resources each node declares itself): run it with `testbed compose` "
                           "without --swarm, or without gpus")
    names = [service_name(rank) for rank in range(scenario.count)]
    scenario_config = _digest_name("scenario", directory / SCENARIO_COPY)
    configs = {scenario_config: {"file": f"./{SCENARIO_COPY}"}}
    mounted = [{"source": scenario_config, "target": f"/scenario/{SCENARIO_COPY}",
                "mode": READ_ONLY}]
    for file in data:
        name = _digest_name("data", directory / file)
        configs[name] = {"file": f"./{file}"}
        mounted.append({"source": name, "target": f"/scenario/{file}", "mode": READ_ONLY})
    secrets: dict[str, Any] = {}
    if scenario.authenticates("compose"):
        secrets[_digest_name("key", directory / KEY_COPY)] = {"file": f"./{KEY_COPY}"}
    services: dict[str, Any] = {}
    for rank in range(scenario.count):
        placed = constraints(scenario, rank, place)
        service: dict[str, Any] = {
            "image": f"${{WORKER_IMAGE:-{WORKER_IMAGE}}}",
            "command": worker_command(scenario, rank, names, steps=steps, job_files=job_files,
                                      iface=AUTO_IFACE),
            "cap_add": ["NET_ADMIN"],
            "init": True,
            "stop_grace_period": "5s",
            "labels": worker_labels(scenario, rank),
            "configs": mounted,
            **({"secrets": [{"source": name, "target": KEY_FILE.name, "mode": OWNER_ONLY}
                            for name in secrets]} if secrets else {}),
            "volumes": [_bind(runs, "/runs"),
                        *([_bind(job_files, "/job", read_only=True)] if job_files else [])],
            "networks": [NETWORK],
            "deploy": {"endpoint_mode": "dnsrr", "replicas": 1,
                       "restart_policy": restart_policy(scenario, rank),
                       **({"placement": {"constraints": placed}} if placed else {})},
        }
        services[service_name(rank)] = service
    return {"version": VERSION, "services": services, "networks": _network(scenario, subnet),
            "configs": configs,
            **({"secrets": secrets} if secrets else {})}


def monitoring_stack(scenario: Scenario, directory: Path, *, runs: str = "./runs",
                     grafana: bool = True, subnet: str | None = None) -> dict[str, Any]:
    """Prometheus (and Grafana) for the workers' stack, deployed with it (`-c` both files):
    on a manager, their ports published on it; their files as configs from `directory`."""
    ports = {"mode": "host", "protocol": "tcp"}
    prometheus_config = _digest_name("prometheus", directory / PROMETHEUS_CONFIG)
    configs = {prometheus_config: {"file": f"./{PROMETHEUS_CONFIG}"}}
    services: dict[str, Any] = {"prometheus": {
        **prometheus_service(),
        "configs": [{"source": prometheus_config,
                     "target": f"/etc/prometheus/{PROMETHEUS_CONFIG}", "mode": READ_ONLY}],
        "volumes": [_bind(runs, "/runs", read_only=True),
                    {"type": "tmpfs", "target": "/prometheus"}],
        "ports": [{"target": PROMETHEUS_PORT, "published": PROMETHEUS_PORT, **ports}],
        "networks": [NETWORK],
        "deploy": {"placement": {"constraints": [MANAGER]}},
    }}
    if grafana:
        mounted = []
        for source, target in _grafana_files(directory):
            name = _digest_name(f"grafana-{Path(source).stem}", directory / source)
            configs[name] = {"file": f"./{source}"}
            mounted.append({"source": name, "target": target, "mode": READ_ONLY})
        services["grafana"] = {
            **grafana_service(),
            "configs": mounted,
            "ports": [{"target": GRAFANA_PORT, "published": GRAFANA_PORT, **ports}],
            "networks": [NETWORK],
            "deploy": {"placement": {"constraints": [MANAGER]}},
        }
    return {"version": VERSION, "services": services, "networks": _network(scenario, subnet),
            "configs": configs}


def _grafana_files(directory: Path) -> list[tuple[str, str]]:
    """Grafana's provisioning and dashboards beside the stack, each with where Grafana reads
    it (a config is one file: a directory cannot be one)."""
    found = []
    for path in sorted((directory / "grafana" / "provisioning").rglob("*.yaml")):
        relative = path.relative_to(directory / "grafana" / "provisioning")
        found.append((str(path.relative_to(directory)), f"/etc/grafana/provisioning/{relative}"))
    for path in sorted((directory / "grafana" / "dashboards").glob("*.json")):
        found.append((str(path.relative_to(directory)), f"{GRAFANA_DASHBOARDS}/{path.name}"))
    return found


def write_stack(scenario_path: Path, out: Path, *, steps: int | None = None,
                place: Place = "groups", runs: Path | None = None, grafana: bool = True,
                subnet: str | None = None, root: Path = ROOT) -> tuple[Path, Path]:
    """Write the stack for the scenario at `scenario_path` into `out`: the files beside it
    (`write_files`), the workers' stack file and the monitoring one; returns their paths.
    `runs`: an absolute host path every node has (default: `out`/runs, written relative);
    `grafana` False leaves Grafana out (where its image cannot be had)."""
    if runs is not None and not runs.is_absolute():
        raise ComposeError(f"runs: a path every node has, absolute; got {runs}")
    scenario = write_files(scenario_path, out, steps=steps, root=root)
    bound = "./runs" if runs is None else str(runs)
    job_files = job_directory(scenario, scenario_path, out)
    stack, monitoring = out / STACK_FILE, out / MONITORING_FILE
    stack.write_text(dump(swarm_stack(scenario, out, steps=steps, place=place, runs=bound,
                                      job_files=job_files, subnet=subnet,
                                      data=data_files(scenario, scenario_path.parent))))
    monitoring.write_text(dump(monitoring_stack(scenario, out, runs=bound, grafana=grafana,
                                                subnet=subnet)))
    return stack, monitoring


def default_directory(scenario: Scenario) -> Path:
    """Where `testbed compose --swarm` writes by default: build/swarm/<scenario> beside the
    Compose projects' build/compose/."""
    return compose_directory(scenario).parents[1] / "swarm" / project_name(scenario.name)
