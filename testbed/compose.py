"""A Docker Compose project for a scenario: `testbed compose SCENARIO` writes it.

One service per worker (`worker-N`, the worker image running `testbed node`, see
`testbed.cluster.node`), at a fixed address on a user-defined bridge, with `cap_add:
[NET_ADMIN]` (to shape its own ingress), `init: true` (signals reach the worker; `down` does
not wait out a timeout), and `restart: on-failure` only for the workers the timeline restarts
(a preempted worker exits by SIGKILL and Docker brings it back); Prometheus scraping every
worker, and Grafana with the provisioned datasource and dashboards (grafana/). Published
ports are on 127.0.0.1 only.

The project is generated from the scenario file each time (nothing to keep in sync by hand):
the scenario is copied beside it, and `check_compose` says whether a project still matches.
Where the scenario authenticates (`security.authenticate`, on by default here: a Compose network
may be shared), each generation writes a new secret for the run beside the project (`run.key`,
mode 0600, no other copy) and mounts it read-only into every worker (`node.KEY_FILE`).
"""

from __future__ import annotations

import copy
import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from netem.extras import require
from testbed.cluster.node import KEY_FILE, preempting
from testbed.cluster.worker import PORTS
from testbed.scenario import load_scenario
from testbed.scenario.model import Scenario
from testbed.transport.auth import write_key

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the image's build context, grafana/
SUBNET = "172.28.0.0/24"
FIRST_WORKER = 10  # worker r is at the subnet's address FIRST_WORKER + r
WORKER_IMAGE = "testbed-worker:latest"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"
GRAFANA_IMAGE = "grafana/grafana:11.2.0"
PROMETHEUS_PORT, GRAFANA_PORT = 9090, 3000
SCRAPE_INTERVAL = "2s"
FILE, PROMETHEUS_CONFIG, SCENARIO_COPY = "docker-compose.yaml", "prometheus.yml", "scenario.yaml"
KEY_COPY = "run.key"  # the run's secret beside the project, where the scenario authenticates


class ComposeError(ValueError):
    """A scenario that cannot run under Compose; the message names the field."""


def worker_addresses(count: int, subnet: str = SUBNET) -> list[str]:
    network = ipaddress.ip_network(subnet)
    if FIRST_WORKER + count >= network.num_addresses - 1:
        raise ComposeError(f"workers: {count} do not fit in {subnet}")
    return [str(network[FIRST_WORKER + rank]) for rank in range(count)]


def check_scenario(scenario: Scenario) -> None:
    """What Compose cannot do: worker 0 serves the run's store, so it must not be preempted."""
    if 0 in preempting(scenario):
        raise ComposeError("timeline: worker 0 is killed or restarted; under Compose it serves "
                           "the run's store and must stay up (preempt another worker)")


def compose_project(scenario: Scenario, *, steps: int | None = None, subnet: str = SUBNET,
                    root: Path = ROOT, job_files: str | None = None) -> dict[str, Any]:
    """The Compose project (as a dict) for `scenario`, whose copy sits beside the file;
    `job_files`: a command job's directory (the scenario file's), relative to the project's,
    mounted read-only at /job in every worker."""
    check_scenario(scenario)
    authenticates = scenario.authenticates("compose")
    hosts = worker_addresses(scenario.count, subnet)
    restarted = {rank for rank, events in preempting(scenario).items()
                 if any(event.action == "restart" for event in events)}
    network = ipaddress.ip_network(subnet)
    build = {"context": str(root), "dockerfile": "compose/Dockerfile",
             "args": {"BASE_IMAGE": "${BASE_IMAGE:-python:3.11-slim-bookworm}",
                      "PIP_OPTIONS": "${PIP_OPTIONS:-}"}}
    services: dict[str, Any] = {}
    for rank in range(scenario.count):
        command = ["node", f"/scenario/{SCENARIO_COPY}", "--rank", str(rank),
                   "--hosts", ",".join(hosts)]
        if steps is not None:
            command += ["--steps", str(steps)]
        if job_files is not None:
            command += ["--base-dir", "/job"]
        services[f"worker-{rank}"] = {
            "image": WORKER_IMAGE,
            "build": copy.deepcopy(build),  # a copy each: no YAML anchors in the file
            "command": command,
            "cap_add": ["NET_ADMIN"],
            "init": True,
            "restart": "on-failure" if rank in restarted else "no",
            "stop_grace_period": "5s",
            "volumes": [f"./{SCENARIO_COPY}:/scenario/{SCENARIO_COPY}:ro", "./runs:/runs",
                        *([f"{job_files}:/job:ro"] if job_files is not None else []),
                        *([f"./{KEY_COPY}:{KEY_FILE}:ro"] if authenticates else [])],
            "networks": {"testbed": {"ipv4_address": hosts[rank]}},
            "labels": {"testbed.scenario": scenario.name, "testbed.rank": str(rank)},
        }
    services["prometheus"] = {
        "image": f"${{PROMETHEUS_IMAGE:-{PROMETHEUS_IMAGE}}}",
        "entrypoint": ["prometheus"],
        "command": [f"--config.file=/etc/prometheus/{PROMETHEUS_CONFIG}",
                    "--storage.tsdb.path=/prometheus", f"--web.listen-address=:{PROMETHEUS_PORT}"],
        "volumes": [f"./{PROMETHEUS_CONFIG}:/etc/prometheus/{PROMETHEUS_CONFIG}:ro"],
        "ports": [f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
        "init": True,
        "networks": {"testbed": {"ipv4_address": str(network[2])}},
    }
    services["grafana"] = {
        "image": f"${{GRAFANA_IMAGE:-{GRAFANA_IMAGE}}}",
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true",
                        "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH":
                            "/var/lib/grafana/dashboards/overview.json"},
        "volumes": [f"{root / 'grafana' / 'provisioning'}:/etc/grafana/provisioning:ro",
                    f"{root / 'grafana' / 'dashboards'}:/var/lib/grafana/dashboards:ro"],
        "ports": [f"127.0.0.1:{GRAFANA_PORT}:{GRAFANA_PORT}"],
        "depends_on": ["prometheus"],
        "networks": {"testbed": {"ipv4_address": str(network[3])}},
    }
    return {
        "name": f"testbed-{project_name(scenario.name)}",
        "services": services,
        "networks": {"testbed": {"driver": "bridge", "ipam": {"config": [{"subnet": subnet}]}}},
    }


def prometheus_config(scenario: Scenario, subnet: str = SUBNET) -> dict[str, Any]:
    """Scrape every worker with the labels the dashboards filter on (scenario, run, worker)."""
    hosts = worker_addresses(scenario.count, subnet)
    ports = {"testbed": PORTS["metrics"]}
    if scenario.command is not None and scenario.command.metrics_port is not None:
        ports["program"] = scenario.command.metrics_port  # a command job's own metrics
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{
            "job_name": "testbed",
            "static_configs": [
                {"targets": [f"{host}:{port}"],
                 "labels": {"scenario": scenario.name, "run": "compose", "worker": str(rank),
                            "source": source}}
                for source, port in ports.items() for rank, host in enumerate(hosts)
            ],
        }],
    }


def write_project(scenario_path: Path, out: Path, *, steps: int | None = None,
                  subnet: str = SUBNET) -> Path:
    """Write the project for the scenario at `scenario_path` into `out` (the compose file, the
    scenario's copy, Prometheus's config, `runs/`, and a new secret where it authenticates);
    returns the compose file's path."""
    scenario = load_scenario(scenario_path, steps=steps)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    if scenario_path.resolve() != (out / SCENARIO_COPY).resolve():
        shutil.copyfile(scenario_path, out / SCENARIO_COPY)
    (out / PROMETHEUS_CONFIG).write_text(_dump(prometheus_config(scenario, subnet)))
    if scenario.authenticates("compose"):
        write_key(out / KEY_COPY)
    else:
        (out / KEY_COPY).unlink(missing_ok=True)
    path = out / FILE
    job_files = None
    if scenario.command is not None:  # the user's files, where the scenario file is
        job_files = os.path.relpath(scenario_path.resolve().parent, out.resolve())
    path.write_text(_dump(compose_project(scenario, steps=steps, subnet=subnet,
                                          job_files=job_files)))
    return path


def check_compose(directory: Path) -> list[str]:
    """How the project in `directory` differs from what its scenario copy makes now (empty:
    in sync). Steps and subnet are taken from the project itself."""
    project = yaml.safe_load((directory / FILE).read_text())
    first = project["services"]["worker-0"]["command"]
    steps = int(first[first.index("--steps") + 1]) if "--steps" in first else None
    subnet = project["networks"]["testbed"]["ipam"]["config"][0]["subnet"]
    scenario = load_scenario(directory / SCENARIO_COPY, steps=steps)
    volumes = project["services"]["worker-0"]["volumes"]
    job_files = next((v.rsplit(":", 2)[0] for v in volumes if ":/job:" in v), None)
    wanted = {FILE: compose_project(scenario, steps=steps, subnet=subnet, job_files=job_files),
              PROMETHEUS_CONFIG: prometheus_config(scenario, subnet)}
    stale = [name for name, data in wanted.items()
             if yaml.safe_load((directory / name).read_text()) != data]
    if scenario.authenticates("compose") and not (directory / KEY_COPY).exists():
        stale.append(KEY_COPY)
    return stale


def project_name(name: str) -> str:
    """A scenario's name as a Compose project name (lowercase letters, digits, dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "scenario"


def _dump(data: dict[str, Any]) -> str:
    header = "# Generated by `testbed compose`; regenerate it rather than editing it.\n"
    return header + yaml.safe_dump(data, sort_keys=False, width=100)


def default_directory(scenario: Scenario) -> Path:
    """Where `testbed compose` writes by default: build/compose/<scenario> of the checkout, or
    of the current directory when the package is installed elsewhere."""
    base = ROOT if (ROOT / "compose" / "Dockerfile").exists() else Path(os.getcwd())
    return base / "build" / "compose" / project_name(scenario.name)


def remove_projects() -> tuple[list[str], list[str]]:
    """Remove the containers and networks of every Compose project of the testbed's (found by
    the workers' `testbed.scenario` label) that has no running container: what a killed `up`
    or an ended run left. A project with a running worker may be someone's live run: it is
    left alone. Returns (the projects removed, those left running). Nothing to do, and no
    error, where no Docker Engine answers."""
    try:
        docker = require("docker", "compose", "Docker Engine's API")
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception:  # no SDK, no engine, no permission: nothing of ours can be running
        return [], []
    projects: dict[str, bool] = {}  # project -> whether one of its workers runs
    for container in client.containers.list(all=True, filters={"label": "testbed.scenario"}):
        project = container.labels.get("com.docker.compose.project", "")
        if project:
            projects[project] = projects.get(project, False) or container.status == "running"
    removed = sorted(project for project, running in projects.items() if not running)
    for project in removed:
        label = {"label": f"com.docker.compose.project={project}"}
        for container in client.containers.list(all=True, filters=label):
            container.remove(force=True)
        for network in client.networks.list(filters=label):
            network.remove()
    return removed, sorted(project for project, running in projects.items() if running)
