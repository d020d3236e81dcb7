"""A Docker Compose project for a scenario: `testbed compose SCENARIO` writes it.

One service per worker (`worker-N`, the worker image running `testbed node`, see
`testbed.cluster.node`), at a fixed address on a user-defined bridge, with `cap_add:
[NET_ADMIN]` (to shape its own ingress), `init: true` (signals reach the worker; `down` does
not wait out a timeout), a healthcheck on its metrics endpoint, and `restart: on-failure` only
for the workers the timeline restarts (a preempted worker exits by SIGKILL and Docker brings it
back). Under the `monitoring` profile, Prometheus (its data in a named volume) scrapes the
workers that worker 0 lists for the run (`runs/prometheus-targets.json`, each run its own `run`
label) and Grafana shows them with the provisioned datasource and dashboards (grafana/).
Published ports are on 127.0.0.1 only.

The project is portable: every path in it is relative to its directory (the build context is
the checkout, reached relatively; the dashboards are copied beside the file), and the image's
build is written once (a YAML anchor every worker refers to). It is generated from the scenario
file each time (nothing to keep in sync by hand): the scenario is copied beside it, and
`check_compose` says whether a project still matches. Where the scenario authenticates
(`security.authenticate`, on by default here: a Compose network may be shared), each
generation writes a new secret for the run beside the project (`run.key`, mode 0600, no other
copy) and mounts it read-only into every worker (`node.KEY_FILE`).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from netem.extras import require
from testbed.cluster.node import KEY_FILE, preempting, restarted_workers, service_name
from testbed.cluster.relay import TARGETS_FILE
from testbed.cluster.worker import PORTS
from testbed.scenario import load_scenario
from testbed.scenario.model import Scenario
from testbed.transport.auth import write_key

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the image's build context, grafana/
SUBNET = "172.28.0.0/24"
FIRST_WORKER = 10  # worker r is at the subnet's address FIRST_WORKER + r
WORKER_IMAGE = "testbed-worker:latest"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"
GRAFANA_IMAGE = "grafana/grafana:11.2.0"
PROMETHEUS_PORT, GRAFANA_PORT = 9090, 3000
SCRAPE_INTERVAL = "2s"
FILE, PROMETHEUS_CONFIG, SCENARIO_COPY = "docker-compose.yaml", "prometheus.yml", "scenario.yaml"
MONITORING = "monitoring"  # the profile of Prometheus and Grafana
GRAFANA_DIRS = ("provisioning", "dashboards")  # copied from grafana/ into the project
GRAFANA_DASHBOARDS = "/var/lib/grafana/dashboards"  # where grafana/provisioning looks
# A worker's first answer on its metrics endpoint comes after it imported torch: a minute or
# more on a busy host; until then failed checks do not count.
WORKER_START = "180s"
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


def _fetch(url: str) -> str:
    """Python that fails unless `url` answers."""
    return f"import urllib.request as u; u.urlopen('{url}', timeout=3)"


def worker_command(scenario: Scenario, rank: int, hosts: list[str], *, steps: int | None,
                   job_files: str | None, iface: str | None = None) -> list[str]:
    """Worker `rank`'s `testbed node` command line: the scenario's copy as mounted, every
    worker's address or name (`hosts`), the run's length, a command job's files at /job, and
    the interface to shape (None: the node's default, eth0)."""
    command = ["node", f"/scenario/{SCENARIO_COPY}", "--rank", str(rank),
               "--hosts", ",".join(hosts)]
    if steps is not None:
        command += ["--steps", str(steps)]
    if job_files is not None:
        command += ["--base-dir", "/job"]
    if iface is not None:
        command += ["--iface", iface]
    return command


def worker_labels(scenario: Scenario, rank: int) -> dict[str, str]:
    """A worker container's labels: its scenario and rank (what `testbed clean` looks for)."""
    return {"testbed.scenario": scenario.name, "testbed.rank": str(rank)}


def prometheus_service() -> dict[str, Any]:
    """Prometheus as a service of either placement: the image (overridable), the command over
    the project's configuration, and a readiness healthcheck; the placement adds its mounts,
    network and port."""
    ready = f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready"
    return {
        "image": f"${{PROMETHEUS_IMAGE:-{PROMETHEUS_IMAGE}}}",
        "entrypoint": ["prometheus"],
        "command": [f"--config.file=/etc/prometheus/{PROMETHEUS_CONFIG}",
                    "--storage.tsdb.path=/prometheus", f"--web.listen-address=:{PROMETHEUS_PORT}"],
        "init": True,
        # prom/prometheus has busybox's wget; the image built from Debian's package, Python
        "healthcheck": {"test": ["CMD-SHELL", f"wget -q -O /dev/null {ready} 2>/dev/null || "
                                 f"python3 -c \"{_fetch(ready)}\""],
                        "interval": "2s", "timeout": "5s", "retries": 30},
    }


def grafana_service() -> dict[str, Any]:
    """Grafana as a service of either placement: the image (overridable) and anonymous
    viewing with the overview dashboard as the home page; the placement adds the
    provisioning and dashboards, network and port."""
    return {
        "image": f"${{GRAFANA_IMAGE:-{GRAFANA_IMAGE}}}",
        "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true",
                        "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH":
                            f"{GRAFANA_DASHBOARDS}/overview.json"},
    }


def compose_project(scenario: Scenario, *, steps: int | None = None, subnet: str = SUBNET,
                    context: str = "../../..", job_files: str | None = None) -> dict[str, Any]:
    """The Compose project (as a dict) for `scenario`, whose copy sits beside the file;
    `context`: the checkout (the image's build context), relative to the project's directory;
    `job_files`: a command job's directory (the scenario file's), relative to the project's,
    mounted read-only at /job in every worker. The workers share one `build` and one
    `healthcheck` object, which the file writes once and refers to."""
    check_scenario(scenario)
    authenticates = scenario.authenticates("compose")
    hosts = worker_addresses(scenario.count, subnet)
    restarts = restarted_workers(scenario)
    network = ipaddress.ip_network(subnet)
    build = {"context": context, "dockerfile": "compose/Dockerfile",
             "args": {"BASE_IMAGE": "${BASE_IMAGE:-python:3.11-slim-bookworm}",
                      "PIP_OPTIONS": "${PIP_OPTIONS:-}"}}
    metrics = f"http://127.0.0.1:{PORTS['metrics']}/metrics"
    health = {"test": ["CMD", "python", "-c", _fetch(metrics)], "interval": "5s",
              "timeout": "5s", "retries": 3, "start_period": WORKER_START}
    services: dict[str, Any] = {}
    for rank in range(scenario.count):
        service: dict[str, Any] = {
            "image": WORKER_IMAGE,
            "build": build,
            "command": worker_command(scenario, rank, hosts, steps=steps, job_files=job_files),
            "cap_add": ["NET_ADMIN"],
            "init": True,
            "restart": "on-failure" if rank in restarts else "no",
            "stop_grace_period": "5s",
            "healthcheck": health,
            "volumes": [f"./{SCENARIO_COPY}:/scenario/{SCENARIO_COPY}:ro", "./runs:/runs",
                        *([f"{job_files}:/job:ro"] if job_files is not None else []),
                        *([f"./{KEY_COPY}:{KEY_FILE}:ro"] if authenticates else [])],
            "networks": {"testbed": {"ipv4_address": hosts[rank]}},
            "labels": worker_labels(scenario, rank),
        }
        if rank:  # worker 0 serves the run's store; the others wait for it there
            service["depends_on"] = {service_name(0): {"condition": "service_started"}}
        services[service_name(rank)] = service
    services["prometheus"] = {
        **prometheus_service(),
        "profiles": [MONITORING],
        "volumes": [f"./{PROMETHEUS_CONFIG}:/etc/prometheus/{PROMETHEUS_CONFIG}:ro",
                    "./runs:/runs:ro", "prometheus-data:/prometheus"],
        "ports": [f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
        "networks": {"testbed": {"ipv4_address": str(network[2])}},
    }
    services["grafana"] = {
        **grafana_service(),
        "profiles": [MONITORING],
        "volumes": ["./grafana/provisioning:/etc/grafana/provisioning:ro",
                    f"./grafana/dashboards:{GRAFANA_DASHBOARDS}:ro"],
        "ports": [f"127.0.0.1:{GRAFANA_PORT}:{GRAFANA_PORT}"],
        "depends_on": {"prometheus": {"condition": "service_healthy"}},
        "networks": {"testbed": {"ipv4_address": str(network[3])}},
    }
    return {
        "name": f"testbed-{project_name(scenario.name)}",
        "services": services,
        "networks": {"testbed": {"driver": "bridge", "ipam": {"config": [{"subnet": subnet}]}}},
        "volumes": {"prometheus-data": {}},
    }


def prometheus_config() -> dict[str, Any]:
    """Scrape the targets worker 0 lists for the current run (`runs/prometheus-targets.json`,
    labelled with the scenario, the run and the worker the dashboards filter on)."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{
            "job_name": "testbed",
            "file_sd_configs": [{"files": [f"/runs/{TARGETS_FILE}"],
                                 "refresh_interval": SCRAPE_INTERVAL}],
        }],
    }


def write_project(scenario_path: Path, out: Path, *, steps: int | None = None,
                  subnet: str = SUBNET, root: Path = ROOT) -> Path:
    """Write the project for the scenario at `scenario_path` into `out` (the compose file, the
    scenario's copy, Prometheus's config, the dashboards, `runs/`, and a new secret where it
    authenticates); returns the compose file's path. Every path in it is relative to `out`."""
    scenario = write_files(scenario_path, out, steps=steps, root=root)
    path = out / FILE
    job_files = job_directory(scenario, scenario_path, out)
    context = os.path.relpath(root.resolve(), out.resolve())
    path.write_text(dump(compose_project(scenario, steps=steps, subnet=subnet, context=context,
                                          job_files=job_files)))
    return path


def write_files(scenario_path: Path, out: Path, *, steps: int | None = None,
                root: Path = ROOT) -> Scenario:
    """What a project of either placement has beside its file: `runs/`, the scenario's copy,
    Prometheus's configuration, the dashboards and their provisioning, and a new secret
    where the scenario authenticates (any previous one removed where it does not). Returns
    the scenario, loaded and checked for Compose."""
    scenario = load_scenario(scenario_path, steps=steps)
    check_scenario(scenario)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(exist_ok=True)
    if scenario_path.resolve() != (out / SCENARIO_COPY).resolve():
        shutil.copyfile(scenario_path, out / SCENARIO_COPY)
    (out / PROMETHEUS_CONFIG).write_text(dump(prometheus_config()))
    for name in GRAFANA_DIRS:
        shutil.copytree(root / "grafana" / name, out / "grafana" / name, dirs_exist_ok=True)
    if scenario.authenticates("compose"):
        write_key(out / KEY_COPY)
    else:
        (out / KEY_COPY).unlink(missing_ok=True)
    return scenario


def job_directory(scenario: Scenario, scenario_path: Path, out: Path) -> str | None:
    """A command job's files (the scenario file's directory), relative to the project's;
    None for the built-in jobs."""
    if scenario.command is None:
        return None
    return os.path.relpath(scenario_path.resolve().parent, out.resolve())


def check_compose(directory: Path) -> list[str]:
    """How the project in `directory` differs from what its scenario copy makes now (empty:
    in sync). Steps and subnet are taken from the project itself."""
    project = yaml.safe_load((directory / FILE).read_text())
    first = project["services"][service_name(0)]
    steps = (int(first["command"][first["command"].index("--steps") + 1])
             if "--steps" in first["command"] else None)
    subnet = project["networks"]["testbed"]["ipam"]["config"][0]["subnet"]
    scenario = load_scenario(directory / SCENARIO_COPY, steps=steps)
    job_files = next((v.rsplit(":", 2)[0] for v in first["volumes"] if ":/job:" in v), None)
    wanted = {FILE: compose_project(scenario, steps=steps, subnet=subnet, job_files=job_files,
                                    context=first["build"]["context"]),
              PROMETHEUS_CONFIG: prometheus_config()}
    stale = [name for name, data in wanted.items()
             if yaml.safe_load((directory / name).read_text()) != data]
    if scenario.authenticates("compose") and not (directory / KEY_COPY).exists():
        stale.append(KEY_COPY)
    return stale


def project_name(name: str) -> str:
    """A scenario's name as a Compose project name (lowercase letters, digits, dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "scenario"


class _Dumper(yaml.SafeDumper):
    """Names an object written once and referred to after (`&worker-build`, `*worker-build`)
    by what it is, instead of PyYAML's `id001`."""

    def generate_anchor(self, node: yaml.Node) -> str:
        keys = {key.value for key, _ in node.value} if isinstance(node, yaml.MappingNode) else set()
        return ("worker-build" if "dockerfile" in keys
                else "worker-healthcheck" if "start_period" in keys
                else super().generate_anchor(node))


def dump(data: dict[str, Any]) -> str:
    """YAML of a generated file, with the header that says not to edit it."""
    header = "# Generated by `testbed compose`; regenerate it rather than editing it.\n"
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)


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
