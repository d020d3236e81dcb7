"""`testbed run` end to end on the host kernel (root, namespaces, the fallback's loss): a small
scenario trains across shaped links, the run directory holds every worker's steps and the
timeline's faults, the report renders, and nothing of the network is left."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from live import ended, start_run, wait_for
from typer.testing import CliRunner

from netem.lab import lab_namespaces
from testbed.cli import app
from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns

STEPS = 6
SCENARIO = f"""
name: run-e2e
seed: 3
workers: 3
topology:
  default: {{loss: 2%}}
job: {{model: mlp, steps: {STEPS}, batch: 32}}
collective: {{kind: ring, timeout: 120}}  # 20% loss can grow TCP's retransmission timeout
timeline:
  - step: 3
    set_link: {{link: {{from: 0, to: 1}}, profile: {{loss: 20%}}}}
"""


def test_a_scenario_runs_end_to_end_and_leaves_no_network(tmp_path: Path):
    scenario = tmp_path / "run-e2e.yaml"
    scenario.write_text(SCENARIO)
    cluster = ClusterRun(scenario, run_dir=tmp_path / "run")
    seen: list[int] = []
    result = cluster.run(lambda workers: seen.append(min(w.step for w in workers)))

    assert result.success, result.error
    assert [w.status for w in result.workers] == ["done"] * 3
    assert all(w.step == STEPS - 1 for w in result.workers)
    assert seen and seen[-1] == STEPS - 1, "the display never saw the last step"
    run = load_run(result.run_dir)
    steps = {(event.rank, event.step) for event in run.steps}
    assert steps == {(rank, step) for rank in range(3) for step in range(STEPS)}
    (fault,) = run.faults
    assert fault.action == "set_link" and fault.fields.get("step") == 3
    # Each worker's start-up stages, in order, before its first step (benchmarks/startup.py).
    startups = {event["rank"]: event for event in run.other if event["type"] == "startup"}
    assert set(startups) == {0, 1, 2}
    for rank, event in startups.items():
        first = min(s.t for s in run.steps if s.rank == rank)
        stages = [event[stage] for stage in ("entered", "loaded", "connected", "built", "ready")]
        assert stages[0] >= 0 and stages == sorted(stages) and stages[-1] <= first, event
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["success"] is True
    assert result.html is not None and result.html.exists()
    prefix = next(event for event in run.other if event.get("type") == "cluster")["prefix"]
    assert lab_namespaces(prefix) == [], "the run left namespaces behind"


def test_run_json_prints_the_summary_alone(tmp_path: Path):
    scenario = tmp_path / "run-e2e.yaml"
    scenario.write_text(SCENARIO)
    result = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(scenario),
                             "--sandbox", "none", "--json", "-o", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["success"] is True and summary["steps"] == STEPS


def test_cli_refuses_a_bad_scenario_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nworkers: 3\ncollective: {kind: rign}\n")
    result = CliRunner().invoke(app, ["run", str(bad), "--sandbox", "none"])
    assert result.exit_code == 2
    assert "collective.kind" in result.output


def test_the_quickstart_runs_in_a_guest_when_this_kernel_lacks_netem(tmp_path: Path):
    """The README's main job, shortened: `testbed run quickstart` needs netem's delay; on a
    kernel without sch_netem it runs the whole cluster in a UML guest and says so."""
    from netem.capabilities import netem_available

    out = tmp_path / "quickstart"
    result = CliRunner().invoke(app, ["run", "quickstart", "--steps", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    if not netem_available():
        assert "running in a User-Mode Linux guest" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["success"] is True
    run = load_run(out)
    assert {(event.rank, event.step) for event in run.steps} == {
        (rank, step) for rank in range(4) for step in range(3)}
    assert (out / "index.html").exists()


def _long_run(tmp_path: Path) -> tuple[Any, set[str], list[int]]:
    """`testbed run` of an endless scenario in a process of its own, once training started:
    (the process, the namespaces it made, their worker processes)."""

    scenario = tmp_path / "long.yaml"
    scenario.write_text(SCENARIO.replace(f"steps: {STEPS}", "steps: 100000").replace(
        "name: run-e2e", "name: long"))
    out = tmp_path / "run"
    runner, made = start_run(
        scenario, out, "a worker's first step (the run directory)",
        lambda: any(path.stat().st_size for path in out.glob("events-rank*.jsonl")))
    try:
        workers = [int(pid) for name in made for pid in subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()]
        assert made and workers
    except BaseException:
        runner.kill()
        runner.wait()
        raise
    return runner, made, workers


def test_a_run_killed_with_sigkill_is_cleaned_up_by_testbed_clean(tmp_path: Path):
    """The runner dies without its clean-up: its namespaces and worker processes stay until
    `testbed clean`, which removes exactly them (checked against the kernel's lists)."""
    from pyroute2 import netns

    runner, made, workers = _long_run(tmp_path)
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    assert set(netns.listnetns()) & made == made, "SIGKILL left nothing to clean?"

    result = CliRunner().invoke(app, ["clean"])

    assert result.exit_code == 0, result.output
    assert not set(netns.listnetns()) & made, "testbed clean left namespaces"
    assert not [name for name in made if name in lab_namespaces()]
    for pid in workers:
        wait_for(f"worker {pid} to end after testbed clean", partial(ended, pid), bool, 10.0,
                 every=0.05)


@pytest.mark.parametrize(("signum", "said"), [(signal.SIGINT, "interrupted (Ctrl-C)"),
                                              (signal.SIGTERM, "terminated (SIGTERM)")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_a_run_and_removes_everything_it_made(tmp_path: Path, signum,
                                                                      said):
    """SIGINT (Ctrl-C) or SIGTERM (a `kill`, a CI job's timeout) mid-run: the run ends with
    exit code 128 + the signal's number, its namespaces and worker processes are gone without
    `testbed clean`, and its run directory says which ended it."""
    from pyroute2 import netns

    runner, made, workers = _long_run(tmp_path)
    runner.send_signal(signum)
    try:
        code = runner.wait(60)
    except subprocess.TimeoutExpired:
        runner.send_signal(signal.SIGUSR1)  # its threads' stacks, to its stderr
        with contextlib.suppress(subprocess.TimeoutExpired):
            runner.wait(2)
        runner.kill()
        runner.wait()
        stacks = (tmp_path / "run.stderr").read_text()[-6000:]
        raise AssertionError(f"the run did not end within 60 s of {said}:\n{stacks}") from None

    assert code == 128 + signum
    assert not set(netns.listnetns()) & made, f"{said} left namespaces"
    for pid in workers:
        wait_for(f"worker {pid} to end after {said}", partial(ended, pid), bool, 10.0,
                 every=0.05)
    summary = json.loads(next((tmp_path / "run").rglob("summary.json")).read_text())
    assert summary["success"] is False and said in summary["error"], summary


PREEMPTION = """
name: preempt-rejoin
seed: 5
workers: 4
topology: {{default: {{loss: 1%}}}}
job: {{model: mlp, steps: 80, batch: 32, {job}
      straggler: {{fixed: 200ms}}, optimizer: {{sgd: {{lr: 0.5}}}}}}
collective: {collective}
metrics: {{drift_every: 0}}
timeline:
  - {{step: 10, kill: {worker}}}
  - {{step: 20, restart: {worker}}}
"""
PREEMPTION_STEPS = 80  # 200 ms each: the restarted worker is set up well before the end
REJOINING = {
    # Moshpit pulls from a live neighbour; the last rank.
    "moshpit": ("strategy: average, average_every: 2,",
                "{kind: moshpit, group_size: 2, timeout: 1.0, heartbeat: 0.2}", 3),
    # Lossy pulls through the run's store; a middle rank, which others met over TCP at the
    # start (a rejoining worker skips that meeting).
    "lossy": ("strategy: sharded,", "{kind: lossy, straggler_timeout: 1.0}", 1),
}


@pytest.mark.parametrize("kind", REJOINING)
def test_a_preempted_worker_rejoins_where_the_others_are_with_their_parameters(
        tmp_path: Path, kind: str):
    """A worker killed at step 10 and restarted at step 20: the others go on without it, and
    once set up it comes back at the live step with the live parameters (its first loss is
    the trained model's, not a fresh one's)."""
    job, collective, gone = REJOINING[kind]
    scenario = tmp_path / "preempt.yaml"
    scenario.write_text(PREEMPTION.format(job=job, collective=collective, worker=gone))
    result = ClusterRun(scenario, run_dir=tmp_path / "run").run()

    assert result.success, result.error
    assert [w.status for w in result.workers] == ["done"] * 4
    assert result.workers[gone].restarts == 1
    run = load_run(result.run_dir)
    steps = {rank: sorted(e.step for e in run.steps if e.rank == rank) for rank in range(4)}
    last = PREEMPTION_STEPS - 1
    live = [rank for rank in range(4) if rank != gone]
    for rank in live:
        assert steps[rank] == list(range(PREEMPTION_STEPS)), f"worker {rank} missed steps"
    rejoined = min(s for s in steps[gone] if s > 12)  # the kill may come during step 10
    assert steps[gone][-1] == last and rejoined >= 20, steps[gone]  # not before its restart
    assert set(range(rejoined, PREEMPTION_STEPS)) <= set(steps[gone]), "the rejoiner skipped"
    assert not set(range(13, rejoined)) & set(steps[gone]), "it ran steps while it was killed"
    # The others went on without it while it was gone.
    assert any(gone in e.peers_missing for e in run.steps if e.rank != gone and 12 <= e.step < 20)
    (rejoin,) = [e for e in run.other if e.get("type") == "rejoin"]
    assert rejoin["rank"] == gone and rejoin["step"] == rejoined and rejoin["pulled"] is True
    losses = {(e.rank, e.step): e.loss for e in run.steps}
    fresh = losses[(gone, 0)]
    first_back = losses[(gone, rejoined)]
    peers = [losses[(r, rejoined)] for r in live]
    assert first_back < 0.8 * fresh, (
        f"the rejoined worker's loss {first_back:.3f} is a fresh model's ({fresh:.3f}): "
        f"no parameters were pulled")
    assert abs(first_back - sum(peers) / 3) < 0.5 * fresh, (first_back, peers)
    kinds = [f.action for f in run.faults]
    assert kinds == ["kill", "restart"]


def test_a_worker_restarted_at_the_last_step_comes_back_to_a_finished_job(tmp_path: Path):
    """Restarted as the others take their last step, a worker finds the job over: it is told
    to end while setting up, or its rejoin fails as the store goes with the job's end, or it
    makes the last step. Each way the run succeeds and the worker is done, not failed."""
    scenario = tmp_path / "late.yaml"
    scenario.write_text(PREEMPTION.format(job=REJOINING["moshpit"][0],
                                          collective=REJOINING["moshpit"][1], worker=3)
                        .replace("steps: 80", "steps: 8").replace("step: 10", "step: 2")
                        .replace("step: 20", "step: 7"))
    result = ClusterRun(scenario, run_dir=tmp_path / "run").run()

    assert result.success, result.error
    assert [w.status for w in result.workers] == ["done"] * 4
    assert result.workers[3].restarts == 1
