"""docs/your-code.md's example as it is shipped, on a netem kernel (the UML guest here): the
unmodified torchrun-style DDP script across 4 workers whose links carry 20 ms of delay and 5%
loss, one link made worse by the timeline; every replica ends with the same parameters, and
the report shows the network the run had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netem_kernel
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp" / "scenario.yaml"


def test_the_torchrun_example_runs_unmodified_over_delay_and_loss(tmp_path: Path):
    result = ClusterRun(EXAMPLE, run_dir=tmp_path / "run", backend="netem").run()
    assert result.success, result.error
    run = tmp_path / "run"
    ends = [json.loads((run / "logs" / f"worker-{rank}.stdout").read_text().splitlines()[-1])
            for rank in range(4)]
    assert len({end["checksum"] for end in ends}) == 1, ends
    (fault,) = load_run(run).faults
    assert fault.action == "set_link" and not fault.fields.get("error")
    page = (run / "index.html").read_text()
    assert "<h2>Network</h2>" in page and "delay=20ms loss=5%" in page and "netem" in page
