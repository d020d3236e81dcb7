"""A scenario's Compose project run end to end where netem exists, with what it did to the links:
`testbed compose SCENARIO --up` (docs/compose.md).

`run_project` is the run on whatever kernel the engine shares: `docker compose up -d` of the
workers (and Prometheus, and Grafana when its image can be had), then, while they run, what
the kernel has on each worker's interface (read back with `netem.installed`: which backend,
which rule per peer), one link measured on the wire with a probe train between two worker
containers' namespaces against the rule read back, and Prometheus's view (every worker
scraped, the run's label); then every worker's end, the run directory's verdict, `down`, and
what the project left (nothing, or the check fails). Where this kernel lacks what the scenario
asks for (netem's delay, say), `run_in_guest` does the same inside the User-Mode Linux guest,
whose Docker Engine keeps its images on the engine disk (`testbed.compose.engine`). Both
return one JSON-ready report.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import netem
from netem.probe import compare, probe
from testbed.cluster.node import service_name
from testbed.compose.engine import Engine, EngineError, docker, image_disk, mounted
from testbed.compose.project import (
    GRAFANA_IMAGE,
    MONITORING,
    PROMETHEUS_IMAGE,
    PROMETHEUS_PORT,
    ROOT,
)

LOCAL_PROMETHEUS = "testbed-prometheus:latest"  # scripts/compose-images.sh's, for no registry
START_WAIT = 600.0  # seconds for every worker to shape its links (torch imports come first)
POLL = 1.0  # seconds between looks at containers and Prometheus: they offer nothing to wait on
GUEST_MEM = "6G"  # four workers with torch, Prometheus, and the engine's page cache
GUEST_RESULT = "compose-up.json"  # the guest's report, in the project's directory
IFACE = "eth0"

Say = Callable[[str], None]


class UpError(RuntimeError):
    """A project that could not be brought up, or did not come up as it should."""


def compose(project: Path, env: Mapping[str, str], *args: str, timeout: float = 600.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    return docker(env, "compose", "-f", str(project), *args, timeout=timeout, check=check)


def _services(project: Path) -> dict[str, Any]:
    return yaml.safe_load(project.read_text())["services"]


def _image_env(env: Mapping[str, str], say: Say) -> tuple[dict[str, str], list[str]]:
    """The image variables and the monitoring services this engine can run: Prometheus from
    the registry or the one scripts/compose-images.sh builds; Grafana only from a registry."""
    chosen: dict[str, str] = {}
    services = ["prometheus"]
    if "PROMETHEUS_IMAGE" not in os.environ and docker(
            env, "image", "inspect", PROMETHEUS_IMAGE, check=False).returncode != 0 and docker(
            env, "image", "inspect", LOCAL_PROMETHEUS, check=False).returncode == 0:
        chosen["PROMETHEUS_IMAGE"] = LOCAL_PROMETHEUS
    grafana = os.environ.get("GRAFANA_IMAGE", GRAFANA_IMAGE)
    if docker(env, "image", "inspect", grafana, check=False).returncode == 0 or docker(
            env, "pull", "-q", grafana, check=False, timeout=300).returncode == 0:
        services.append("grafana")
    else:
        say(f"grafana: no image {grafana} here and none to pull: Prometheus only")
    return chosen, services


def _states(project: Path, env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each container of the project: its service's state, exit code and health."""
    listing = compose(project, env, "ps", "-a", "--format", "json").stdout
    rows = [json.loads(line) for line in listing.splitlines() if line.strip()]
    if len(rows) == 1 and isinstance(rows[0], list):  # older Compose: one JSON array
        rows = rows[0]
    return {row["Service"]: {"state": row["State"], "exit_code": row.get("ExitCode"),
                             "health": row.get("Health", "")} for row in rows}


@contextlib.contextmanager
def _namespaces(project: Path, env: Mapping[str, str],
                workers: Sequence[str]) -> Iterator[dict[str, str]]:
    """Each running worker container's network namespace under a name of its own in
    /run/netns (`ip netns attach`), so netem and the probe can reach it; detached after."""
    token, named = secrets.token_hex(3), {}
    try:
        for service in workers:
            container = compose(project, env, "ps", "-q", service).stdout.strip()
            pid = docker(env, "inspect", "-f", "{{.State.Pid}}", container).stdout.strip()
            name = f"tbc-{token}-{service}"
            subprocess.run(["ip", "netns", "attach", name, pid], check=True,
                           capture_output=True)
            named[service] = name
        yield named
    finally:
        for name in named.values():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@contextlib.contextmanager
def _promptly() -> Iterator[None]:
    """Real-time scheduling while a probe train is timed: on a guest whose one vCPU also runs
    the workers, the sender would otherwise be descheduled for whole time slices and the
    train judged too busy to time."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:  # not root, or no real-time share here: time it as it comes
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def _links(namespaces: Mapping[str, str], deadline: float) -> dict[str, dict[str, Any]]:
    """What the kernel has on each worker's interface, once every worker has shaped it."""
    found: dict[str, dict[str, Any]] = {}
    while len(found) < len(namespaces):
        for service, name in namespaces.items():
            if service in found:
                continue
            with contextlib.suppress(OSError, ValueError):
                plan = netem.installed(IFACE, netns=name)
                if plan is not None:
                    found[service] = {"backend": plan.backend, "direction": plan.direction,
                                      "rules": {str(rule.source or "default"): str(rule.profile)
                                                for rule in plan.rules}}
        if len(found) < len(namespaces):
            if time.monotonic() > deadline:
                missing = sorted(set(namespaces) - set(found))
                raise UpError(f"{', '.join(missing)}: no shaping on {IFACE} within "
                              f"{START_WAIT:g} s")
            time.sleep(POLL)
    return found


def _measure(namespaces: Mapping[str, str], hosts: Sequence[str], src: int,
             dst: int) -> dict[str, Any]:
    """Link src -> dst probed on the wire, judged against the rule read back from dst's
    kernel for src's address."""
    receiver = namespaces[service_name(dst)]
    configured = netem.show(IFACE, netns=receiver).get(hosts[src]) or netem.show(
        IFACE, netns=receiver)[None]
    with _promptly():
        result = probe(namespaces[service_name(src)], receiver, hosts[dst])
    checks = compare(configured, result)
    return {"link": f"{src}->{dst}", "configured": str(configured),
            "received": result.received, "sent": result.sent, "trains": result.trains,
            "checks": [{"quantity": c.quantity, "configured": c.configured,
                        "measured": c.measured, "tolerance": c.tolerance, "passed": c.passed,
                        "note": c.note, "shown": f"configured {c.show(c.configured)}, "
                        f"measured {c.show(c.measured)}, tolerance {c.show(c.tolerance)}"}
                       for c in checks]}


def _query(expr: str) -> list[dict[str, Any]]:
    url = (f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?"
           + urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def _scraped(workers: int, deadline: float) -> dict[str, Any]:
    """Prometheus's view while the run is live: which workers' steps it has, with which run
    label; waits until it has every worker (or the deadline)."""
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            seen = {item["metric"]["rank"]: item["metric"].get("run", "")
                    for item in _query("testbed_step")}
        if len(seen) == workers:
            break
        time.sleep(POLL)
    return {"workers": sorted(seen, key=int), "runs": sorted(set(seen.values()))}


class _MemoryPeak:
    """The most memory in use (MemTotal - MemAvailable) seen on the kernel the engine runs on,
    sampled while the project runs."""

    def __init__(self) -> None:
        self.peak = 0
        self.sample()

    def sample(self) -> None:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024
                  for line in Path("/proc/meminfo").read_text().splitlines()}
        self.peak = max(self.peak, fields["MemTotal"] - fields["MemAvailable"])


def run_project(project: Path, env: Mapping[str, str], *, say: Say = print,
                build: bool = True, monitoring: bool = True, keep: bool = False,
                measure: tuple[int, int] | None = (0, 1), timeout: float = 3600.0,
                where: str = "host") -> dict[str, Any]:
    """Bring the project up on the engine `env` names, watch it to its end, take it down
    (unless `keep`), and report (see the module's docstring)."""
    services = _services(project)
    workers = [name for name in services if name.startswith("worker-")]
    hosts = services[workers[0]]["command"][services[workers[0]]["command"].index("--hosts")
                                            + 1].split(",")
    deadline = time.monotonic() + timeout
    report: dict[str, Any] = {"where": where, "project": str(project),
                              "name": yaml.safe_load(project.read_text())["name"]}
    chosen, monitors = _image_env(env, say) if monitoring else ({}, [])
    env = {**env, **chosen}
    started = time.monotonic()
    memory = _MemoryPeak()
    report["costs"] = {}
    say(f"compose: up {' '.join(workers + monitors)}")
    compose(project, env, "up", "-d", *(["--build"] if build else []), *workers, *monitors,
            timeout=1800)
    report["services"] = workers + monitors
    try:
        with _namespaces(project, env, workers) as namespaces:
            report["links"] = _links(namespaces, time.monotonic() + START_WAIT)
            report["shaped_seconds"] = round(time.monotonic() - started, 1)
            say("links: every worker shaped its own ("
                + ", ".join(sorted({link["backend"] for link in report["links"].values()}))
                + ")")
            if measure is not None:
                # The workers are paused meanwhile (they are importing torch, before any
                # traffic of theirs): on a guest's one vCPU they would keep the probe's sender
                # from running on time, and the delays could not be judged.
                compose(project, env, "pause", *workers)
                try:
                    report["measured"] = _measure(namespaces, hosts, *measure)
                finally:
                    compose(project, env, "unpause", *workers)
                for check in report["measured"]["checks"]:
                    say(f"  {report['measured']['link']} {check['quantity']}: {check['shown']}"
                        f": {'pass' if check['passed'] else check['note'] or 'FAIL'}")
        if "prometheus" in monitors:
            report["prometheus"] = _scraped(len(workers), min(deadline, time.monotonic()
                                                              + START_WAIT))
            say(f"prometheus: scraped workers {report['prometheus']['workers']} of run "
                f"{report['prometheus']['runs']}")
        while not all(_states(project, env).get(w, {}).get("state") == "exited"
                      for w in workers):
            if time.monotonic() > deadline:
                raise UpError(f"the workers did not end within {timeout:g} s")
            memory.sample()
            time.sleep(POLL)
        states = _states(project, env)
        report["workers"] = {w: states[w] for w in workers}
        report["seconds"] = round(time.monotonic() - started, 1)
        report["costs"] |= {"up_to_shaped_seconds": report["shaped_seconds"],
                            "run_seconds": report["seconds"],
                            "memory_used_peak_bytes": memory.peak}
        runs = sorted((project.parent / "runs").glob("*/summary.json"),
                      key=lambda path: path.stat().st_mtime)
        if runs:
            summary = json.loads(runs[-1].read_text())
            report["run_dir"] = str(runs[-1].parent)
            report["success"] = bool(summary.get("success")) and all(
                state["exit_code"] == 0 for state in report["workers"].values())
        else:
            report["success"] = False
    except BaseException:
        report["logs"] = compose(project, env, "logs", "--tail", "20", "--no-color",
                                 check=False).stdout[-6000:]
        raise
    finally:
        if not keep:
            down = compose(project, env, "--profile", MONITORING, "down", "-v",
                           "--remove-orphans", "-t", "2", check=False)
            report["left"] = _left(report["name"], env)
            if any(report["left"].values()):
                report["down"] = down.stderr[-3000:]
    return report


def _left(name: str, env: Mapping[str, str]) -> dict[str, list[str]]:
    """What of the project the engine still has: containers, networks, volumes."""
    label = f"label=com.docker.compose.project={name}"
    return {kind: docker(env, kind, "ls", "-q", *(["-a"] if kind == "container" else []),
                         "--filter", label, check=False).stdout.split()
            for kind in ("container", "network", "volume")}


def run_in_guest(project: Path, *, say: Say = print, monitoring: bool = True,
                 measure: tuple[int, int] | None = (0, 1), timeout: float = 3600.0,
                 root: Path = ROOT) -> dict[str, Any]:
    """`run_project` inside the User-Mode Linux guest, on the engine disk; the report comes
    back through the project's directory (the guest's root is this host's)."""
    from netem import sandbox

    kernel = sandbox.prepare(quiet=True)
    result = project.parent / GUEST_RESULT
    result.unlink(missing_ok=True)
    options = {"monitoring": monitoring, "measure": measure, "timeout": timeout}
    argv = [sys.executable, "-m", "testbed.compose.up", str(project.resolve()),
            str(result.resolve()), json.dumps(options)]
    begun = time.monotonic()
    with image_disk(root, say=say) as disk, tempfile.TemporaryDirectory(
            prefix="tb-cow-") as scratch:
        disk_ready = time.monotonic()
        say(f"guest: Docker Engine in a User-Mode Linux guest ({sandbox.describe(kernel)}), "
            f"the images on {disk}")
        # The guest writes to a copy-on-write file, thrown away after: its containers,
        # networks and volumes never reach the disk, whose engine the host starts too.
        guest = sandbox.run(argv, kernel=kernel, mem=GUEST_MEM, timeout=timeout + 600,
                            disks=[sandbox.Disk(disk, cow=Path(scratch) / "guest.cow")])
    ended = time.monotonic()
    if not result.exists():
        raise UpError(f"the guest ended (exit {guest.returncode}) without a report:\n"
                      f"{guest.output[-3000:]}")
    report = json.loads(result.read_text())
    result.unlink()
    if "error" in report:
        raise UpError(f"in the guest: {report['error']}")
    report["costs"] |= {"disk_seconds": round(disk_ready - begun, 1),
                        "guest_seconds": round(ended - disk_ready, 1),
                        "guest_memory_bytes": _bytes(GUEST_MEM),
                        "disk_used_bytes": disk.stat().st_blocks * 512}
    return report


def _bytes(size: str) -> int:
    return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]]


def _in_guest(project: Path, result: Path, options: dict[str, Any]) -> int:
    """The guest's part: its engine on the disk, the run, the report into `result`."""
    from netem.sandbox import disk_device

    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        subprocess.run(["mount", "-t", "cgroup2", "none", "/sys/fs/cgroup"], check=True)
    report: dict[str, Any]
    try:
        with mounted(Path(disk_device(0))) as point:
            begun = time.monotonic()
            with Engine(point / "docker", iptables=False) as engine:
                engine_seconds = time.monotonic() - begun
                measure = options["measure"]
                report = run_project(project, engine.env, build=False, where="guest",
                                     monitoring=options["monitoring"],
                                     measure=None if measure is None else tuple(measure),
                                     timeout=options["timeout"],
                                     say=lambda line: print(line, flush=True))
                report["costs"]["engine_seconds"] = round(engine_seconds, 1)
    except (UpError, EngineError, subprocess.SubprocessError, OSError) as error:
        report = {"error": str(error)}
    result.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report.get("success") else 1


if __name__ == "__main__":  # the guest runs `python -m testbed.compose.up PROJECT RESULT OPTIONS`
    sys.exit(_in_guest(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])))
