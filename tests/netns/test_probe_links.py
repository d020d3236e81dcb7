"""`metrics.probe_links: true`: before training, every directed link of a run is measured with a
probe train, a `link` event each, and the report draws them beside what was configured."""

from __future__ import annotations

import math

import pytest

from testbed.cluster.runner import LINK_PROBES, ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns

SCENARIO = """\
name: probe-links
seed: 1
workers: 3
topology:
  default: {loss: 5%, rate: 100mbit}
  links:
    - {src: 0, dst: 1, profile: {loss: 20%, rate: 100mbit}}
job: {model: mlp, steps: 5, batch: 32}
collective: {kind: ring, timeout: 120}  # 20% loss can grow TCP's retransmission timeout to seconds
metrics: {probe_links: true, linger: 0}
"""


def test_every_link_is_measured_before_training_and_drawn(tmp_path):
    path = tmp_path / "scenario.yaml"
    path.write_text(SCENARIO)
    cluster = ClusterRun(path, run_dir=tmp_path / "run")
    result = cluster.run()
    assert result.success, result.error
    run = load_run(cluster.run_dir)
    measured = {(int(e.src), int(e.dst)): e for e in run.links}
    assert sorted(measured) == [(s, d) for s in range(3) for d in range(3) if s != d]
    first_step = min(step.t for step in run.steps)
    for (src, dst), event in measured.items():
        assert event.t < first_step, "a link was probed after training started"
        loss = 0.2 if (src, dst) == (0, 1) else 0.05
        assert event.configured_loss == pytest.approx(loss)
        # Binomial over LINK_PROBES probes: 5.5 standard errors, a false failure below 4e-8 a
        # link.
        tolerance = 5.5 * math.sqrt(loss * (1 - loss) / LINK_PROBES)
        assert abs(event.measured_loss - loss) < tolerance, (src, dst, event.measured_loss)
    assert (cluster.run_dir / "plots" / "links.png").exists()
