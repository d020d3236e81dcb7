"""The DDP example (examples/ddp) with `--device cuda` as a scenario's job, across 2 workers in
network namespaces sharing the host's first GPU (`job.gpus: 1`), links losing 2% (the host's
fallback: loss only): plain DDP ends with identical replicas, and with the scenario's lossy
all-reduce as its communication hook it trains. Tiers gpu and netns (root)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from testbed.cluster.runner import ClusterRun

pytestmark = [pytest.mark.gpu, pytest.mark.netns]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp"
WORLD = 2
STEPS = 10


def scenario(tmp_path: Path, script: str) -> Path:
    """A scenario running `script` (the example's, copied beside it) on the GPU."""
    for name in ("train.py", "train_lossy.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({
        "name": "ddp-cuda", "workers": WORLD, "topology": {"default": {"loss": "2%"}},
        "job": {"command": ["python", script, "--device", "cuda", "--steps", str(STEPS)],
                "gpus": 1},
        "collective": {"kind": "lossy"},
    }))
    return path


@pytest.mark.parametrize("script", ["train.py", "train_lossy.py"])
def test_the_ddp_example_trains_on_cuda_across_lossy_links(tmp_path: Path, script: str):
    result = ClusterRun(scenario(tmp_path, script), run_dir=tmp_path / "run").run()
    assert result.success, result.error
    lines = [[json.loads(line) for line in (tmp_path / "run" / "logs" / f"worker-{rank}.stdout")
              .read_text().splitlines()] for rank in range(WORLD)]
    steps = [line for line in lines[0] if "step" in line]
    assert len(steps) == STEPS and steps[-1]["loss"] < steps[0]["loss"]
    ends = [rank_lines[-1] for rank_lines in lines]
    assert [end["rank"] for end in ends] == list(range(WORLD))
    if script == "train.py":  # DDP's own all-reduce is exact: every replica the same
        assert len({end["checksum"] for end in ends}) == 1, ends
