"""`docker stack deploy` of a generated stack, for real, on a single-node swarm of the tier's
own engine (initialised here and left again when the tier had none): the quickstart, loss only
(this kernel's fallback: its 5 ms of delay needs netem), its four workers in two groups placed
by node labels, a link change, and worker 3 preempted and brought back by Swarm's restart
policy as a new task. Checked: Prometheus (published on this node) scraped every worker while
the run was live, the link change reached the receiving worker over the overlay, every worker
reached its last step and the run succeeded, worker 3 rejoined after its restart (and, where
its new task got a new address, every peer followed it), and `docker stack rm` left no
service, container, network, config or secret. A second test reads every shipped scenario's
stack with `docker stack config`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from live import promql, wait_for

from testbed.compose.swarm import node_labels, write_stack
from testbed.scenario import find_scenario, load_scenario, scenario_files

pytestmark = pytest.mark.compose

STACK = "testbed-swarm-tier"
# The others train on for 330 steps after worker 3's restart is due: far longer than Swarm takes
# to start a new task (its restart delay included) and the task to rejoin; the figures' swap
# no longer holds them 5 s an exchange while it is away (docs/cluster.md).
STEPS = 400
LIVE_WAIT = 300.0  # seconds for the tasks to start training and Prometheus to see them
END_WAIT = 600.0  # seconds for the whole run
GONE_WAIT = 120.0  # seconds for `docker stack rm` to take everything away
ENV = {"PROMETHEUS_IMAGE": "testbed-prometheus:latest"}


def _docker(*args: str, check: bool = True, timeout: float = 300.0) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **ENV})
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.stderr[-3000:]}")
    return result.stdout


def _scenario(directory: Path) -> Path:
    """The quickstart without its delay, longer, in two groups, with a link change and a
    preemption."""
    data = yaml.safe_load(find_scenario("quickstart").read_text())
    data["name"] = "swarm-tier"
    data["topology"] = {"default": {"loss": "1%"}, "groups": {"a": [0, 1], "b": [2, 3]}}
    data["job"]["steps"] = STEPS
    data["collective"] = {"kind": "lossy", "deadline_initial": 0.2}
    data["metrics"] = {"drift_every": 5, "linger": 20}
    data["timeline"] = [
        {"step": 10, "set_link": {"link": {"src": 0, "dst": 1}, "profile": {"loss": "40%"}}},
        {"step": 40, "kill": [3]},
        {"step": 70, "restart": [3]},
    ]
    path = directory / "scenario.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def swarm(docker_engine) -> Iterator[str]:
    """A swarm this engine manages: initialised here (and left after) where it had none.
    Yields the node's id."""
    state = _docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip()
    initialised = state == "inactive"
    if initialised:
        _docker("swarm", "init", "--advertise-addr", "127.0.0.1")
    try:
        yield _docker("info", "--format", "{{.Swarm.NodeID}}").strip()
    finally:
        if initialised:
            _docker("swarm", "leave", "--force", check=False)


def _tasks() -> list[dict[str, Any]]:
    """Every task of the stack (history included), inspected."""
    ids = _docker("stack", "ps", STACK, "-q", "--no-trunc", check=False).split()
    return json.loads(_docker("inspect", *ids)) if ids else []


def _states() -> dict[str, list[tuple[str, str, int | None, str]]]:
    """Each service's tasks, oldest first: (state, desired state, exit code, address)."""
    services = dict(line.split() for line in _docker(
        "stack", "services", STACK, "--format", "{{.ID}} {{.Name}}", check=False).splitlines())
    found: dict[str, list[tuple[str, str, int | None, str]]] = {}
    for task in sorted(_tasks(), key=lambda t: t["CreatedAt"]):
        service = next((name for short, name in services.items()
                        if task["ServiceID"].startswith(short)), "?")
        addresses = [address.split("/")[0] for attachment in task.get("NetworksAttachments", [])
                     if attachment["Network"]["Spec"]["Name"] == f"{STACK}_testbed"
                     for address in attachment.get("Addresses", [])]
        status = task["Status"]
        found.setdefault(service.removeprefix(f"{STACK}_"), []).append((
            status["State"], task["DesiredState"],
            status.get("ContainerStatus", {}).get("ExitCode"), ",".join(addresses)))
    return found


def _left() -> dict[str, list[str]]:
    """What of the stack the engine still has."""
    label = f"label=com.docker.stack.namespace={STACK}"
    return {kind: _docker(*command, "--filter", label, "-q", check=False).split()
            for kind, command in (("service", ("service", "ls")),
                                  ("container", ("ps", "-a")),
                                  ("network", ("network", "ls")),
                                  ("config", ("config", "ls")),
                                  ("secret", ("secret", "ls")))}


def _diagnose() -> str:
    """What a failed run looked like, before `stack rm`: every task, every service's log."""
    parts = [_docker("stack", "ps", STACK, "--no-trunc", check=False)]
    for service in _docker("stack", "services", STACK, "--format", "{{.Name}}",
                           check=False).split():
        parts.append(f"--- {service}")
        parts.append(_docker("service", "logs", "--tail", "30", "--no-task-ids", service,
                             check=False))
    return "\n".join(parts)


@contextlib.contextmanager
def _deployed(*files: Path) -> Iterator[None]:
    """The stack deployed from `files`; on a failure, what it looked like; `stack rm` and
    the wait until it is all gone in every case."""
    try:
        _docker("stack", "deploy", "--resolve-image", "never",
                *[arg for path in files for arg in ("-c", str(path))], STACK)
        yield
    except BaseException:
        print(_diagnose())
        raise
    finally:
        _docker("stack", "rm", STACK, check=False)
        wait_for("docker stack rm to leave nothing", _left,
                 lambda left: not any(left.values()), GONE_WAIT)


def test_a_stack_on_a_single_node_swarm_runs_to_its_end_and_leaves_nothing(swarm, tmp_path):
    scenario_path = _scenario(tmp_path)
    scenario = load_scenario(scenario_path)
    directory = tmp_path / "stack"
    stack, monitoring = write_stack(scenario_path, directory, grafana=False)
    labels = list(node_labels(scenario, "groups"))
    assert labels == ["testbed.group.a", "testbed.group.b"]
    _docker("node", "update", *[arg for label in labels
                                for arg in ("--label-add", f"{label}=true")], swarm)
    started = time.monotonic()
    try:
        with _deployed(stack, monitoring):
            steps = wait_for("every worker past step 20 in Prometheus",
                             lambda: promql("testbed_step"),
                             lambda found: len(found) == 4 and min(found.values()) > 20,
                             LIVE_WAIT)
            run_labels = {key.split("run=")[1].split(",")[0] for key in steps}
            assert len(run_labels) == 1, steps
            # The link 0->1 was set to 40% at step 10 by worker 1's own timeline, over the
            # overlay: its gauge says so, the other links keep 1%.
            configured = promql('sum by (rank, peer) (testbed_link_loss_ratio'
                               '{direction="in"})')
            assert configured.pop("peer=0,rank=1") == pytest.approx(0.4), configured
            assert len(configured) == 11 and set(configured.values()) == {0.01}, configured
            (run_dir,) = wait_for("the run's summary", lambda: list(
                (directory / "runs").glob("*/summary.json")), lambda found: len(found) == 1,
                END_WAIT)
            states = wait_for(
                "every worker's last task ended",
                _states, lambda found: all(
                    found.get(f"worker-{r}") and found[f"worker-{r}"][-1][0] in (
                        "complete", "failed", "shutdown") for r in range(4)), 120)
            seconds = time.monotonic() - started
    finally:
        _docker("node", "update", *[arg for label in labels
                                    for arg in ("--label-rm", label)], swarm, check=False)
    print(f"swarm run: {seconds:.0f} s from deploy to every worker's end; tasks: {states}")
    run = run_dir.parent
    summary = json.loads(run_dir.read_text())
    assert summary["success"] is True, summary
    assert run_labels == {run.name}
    # Every worker reached the last step.
    for rank in range(4):
        events = [json.loads(line) for line in
                  (run / f"events-rank{rank}.jsonl").read_text().splitlines()]
        assert max(e["step"] for e in events if e["type"] == "step") == STEPS - 1, rank
    # Workers 0-2: one task each, ended 0. Worker 3: killed (SIGKILL, 137), then a new task
    # by the restart policy, which rejoined after step 70 and ended 0.
    for rank in range(3):
        assert [(s, code) for s, _, code, _ in states[f"worker-{rank}"]] == [("complete", 0)]
    (killed, back) = states["worker-3"]
    assert (killed[0], killed[2]) == ("failed", 137) and (back[0], back[2]) == ("complete", 0)
    events = [json.loads(line) for line in (run / "events-rank3.jsonl").read_text().splitlines()]
    rejoin = [e for e in events if e["type"] == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["step"] >= 70, rejoin
    # Swarm's new task may have a new address: if so, worker 0 recorded that it followed it.
    records = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    moved = [(e["rank"], e["previous"], e["host"]) for e in records if e["type"] == "moved"]
    print(f"worker 3's tasks' addresses: {killed[3]} then {back[3]}")
    assert moved == ([] if killed[3] == back[3] else [(3, killed[3], back[3])]), moved
    # The workers found each other by name, and sized their datagrams for the overlay's MTU
    # (at most 1450: VXLAN's 50 bytes less than 1500; below that where the host's NIC has less).
    cluster = next(e for e in records if e["type"] == "cluster")
    assert cluster["names"] == [f"worker-{r}" for r in range(4)], cluster
    assert cluster["mtu"] <= 1450, cluster


def test_docker_stack_config_takes_every_shipped_scenarios_stack(tmp_path):
    """`docker stack config` checks a stack against the compose-file schema (it refuses keys
    the stack format lacks, Compose's `profiles` among them) with the command line alone: no
    engine, no swarm."""
    for path in scenario_files():
        stack, monitoring = write_stack(path, tmp_path / path.stem)
        merged = yaml.safe_load(_docker("stack", "config", "-c", str(stack), "-c",
                                        str(monitoring)))
        workers = load_scenario(path).count
        assert len(merged["services"]) == workers + 2, (path.stem, sorted(merged["services"]))
        worker = merged["services"]["worker-0"]
        assert worker["deploy"]["endpoint_mode"] == "dnsrr", path.stem
        assert worker["cap_add"] == ["NET_ADMIN"] and worker["init"] is True, path.stem
        # Relative paths are taken from the stack file's directory.
        assert worker["volumes"][0]["source"] == str(tmp_path / path.stem / "runs"), worker
