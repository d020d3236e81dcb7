"""The examples of docs/your-code.md on the host kernel (loss only: the fallback; their delay
needs netem, which the netem_kernel tier gives them): the unmodified torchrun-style DDP script
across 4 workers ends with every replica's parameters identical, and the same script with the
scenario's lossy all-reduce as its DDP communication hook trains through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testbed.cluster.runner import ClusterRun

pytestmark = pytest.mark.netns
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp"


def loss_only(name: str, tmp_path: Path) -> Path:
    """The example scenario without its delay (this kernel's fallback shapes loss only),
    running in the example's directory."""
    data = yaml.safe_load((EXAMPLE / name).read_text())
    data["topology"]["default"].pop("delay")
    data["job"]["cwd"] = str(EXAMPLE)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def outputs(run: Path, world: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (run / "logs" / f"worker-{rank}.stdout").read_text()
             .splitlines()] for rank in range(world)]


@pytest.mark.parametrize("name", ["scenario.yaml", "scenario-lossy.yaml"])
def test_the_ddp_example_trains_across_lossy_links(tmp_path: Path, name: str):
    result = ClusterRun(loss_only(name, tmp_path), run_dir=tmp_path / "run").run()
    assert result.success, result.error
    ends = [lines[-1] for lines in outputs(tmp_path / "run", 4)]
    assert [end["rank"] for end in ends] == [0, 1, 2, 3]
    steps = [line for line in outputs(tmp_path / "run", 4)[0] if "step" in line]
    assert len(steps) == 30 and steps[-1]["loss"] < steps[0]["loss"]
    if name == "scenario.yaml":  # DDP over gloo is exact: every replica the same
        assert len({end["checksum"] for end in ends}) == 1, ends
    page = (tmp_path / "run" / "index.html").read_text()
    assert "<h2>Network</h2>" in page and "loss=5%" in page
