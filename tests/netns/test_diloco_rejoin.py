"""`testbed run` of DiLoCo with a worker killed and restarted (root, namespaces): the restarted
worker takes a live worker's outer state through the run's store and joins the others' next
outer step with the same outer state (its count of outer updates is theirs) and the synced
parameters (its first loss is the trained model's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns

STEPS, INNER_STEPS, GONE = 60, 5, 3
SCENARIO = """
name: diloco-rejoin
seed: 5
workers: 4
job: {{model: mlp, steps: {steps}, batch: 32, strategy: diloco, inner_steps: {inner_steps},
      straggler: {{fixed: 200ms}}, optimizer: {{adamw: {{lr: 0.01}}}}}}
collective: {collective}
metrics: {{drift_every: 0}}
timeline:
  - {{step: 10, kill: {gone}}}
  - {{step: 20, restart: {gone}}}
"""
COLLECTIVES = {
    "moshpit": "{kind: moshpit, group_size: 2, timeout: 1.0, heartbeat: 0.2}",
    "lossy": "{kind: lossy, straggler_timeout: 1.0}",
}


@pytest.mark.parametrize("kind", COLLECTIVES)
def test_a_restarted_diloco_worker_rejoins_at_the_next_outer_step_with_the_outer_state(
        tmp_path: Path, kind: str):
    scenario = tmp_path / "diloco.yaml"
    scenario.write_text(SCENARIO.format(steps=STEPS, inner_steps=INNER_STEPS, gone=GONE,
                                        collective=COLLECTIVES[kind]))
    result = ClusterRun(scenario, run_dir=tmp_path / "run").run()

    assert result.success, result.error
    assert result.workers[GONE].restarts == 1
    run = load_run(result.run_dir)
    (rejoin,) = [e for e in run.other if e.get("type") == "rejoin"]
    assert rejoin["rank"] == GONE and rejoin["pulled"] is True
    back = rejoin["step"]
    outer = {(e.rank, e.step): e.extra["outer_step"] for e in run.steps
             if "outer_step" in e.extra}
    # Its first outer step after it came back: the others' count of outer updates, so it
    # took theirs (its own count restarted would be 1).
    first = min(step for rank, step in outer if rank == GONE and step >= back)
    assert (first + 1) % INNER_STEPS == 0
    assert {outer[(rank, first)] for rank in range(4)} == {outer[(0, first)]}
    assert outer[(GONE, first)] == (first + 1) // INNER_STEPS
    losses = {(e.rank, e.step): e.loss for e in run.steps}
    assert losses[(GONE, back)] < 0.8 * losses[(GONE, 0)], "it started from a fresh model"
