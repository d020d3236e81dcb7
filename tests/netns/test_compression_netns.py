"""Training converges with each compressor across network namespaces: a short `ClusterRun` of
the MLP on digits, three workers on shaped links (2% loss for lossy), the scenario's
`collective.compressor` wrapping ring, lossy or gloo. Each run's held-out loss must fall well
below the untrained model's, every worker must end with the same (ring, gloo) or a close
(lossy) model, and the step events must carry the compression figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from testbed.cluster.runner import ClusterRun
from testbed.report import load_run

pytestmark = pytest.mark.netns

WORLD, STEPS = 3, 40
# ln(10): the untrained model's loss on ten balanced classes.
UNTRAINED = math.log(10)
COMPRESSORS = {
    "topk": {"kind": "topk", "density": 0.05},
    "randk": {"kind": "randk", "density": 0.1},
    "arc_topk": {"kind": "arc_topk", "density": 0.05, "block": 16},
    "int8": {"kind": "int8", "group_size": 128},
    "int4": {"kind": "int4", "group_size": 64},
    "powersgd": {"kind": "powersgd", "rank": 4},
}
SPARSIFIERS = ("topk", "randk", "arc_topk")  # EF21M around them: they take resync_every
CASES = [*((kind, "ring") for kind in COMPRESSORS), ("arc_topk", "lossy"), ("int4", "lossy"),
         ("topk", "lossy"), ("arc_topk", "gloo"), ("int8", "gloo")]


def scenario(kind: str, inner: str) -> dict:
    collective = {"kind": inner, "compressor": COMPRESSORS[kind]}
    topology = {"default": {"rate": "200mbit"}}  # (no delay: the host kernel lacks netem)
    if inner == "lossy":
        topology["default"]["loss"] = "2%"
        collective.update(deadline_initial=0.5)
        if kind in SPARSIFIERS:
            # A lost broadcast chunk leaves a worker's copy of EF21M's shared estimate apart
            # from the others' for good, and 40 steps of that drift apart the models (one
            # ended at 1.9 where the others were at 1.4): the resync the docs prescribe.
            collective["compressor"] = {**COMPRESSORS[kind], "resync_every": 10}
    return {"name": f"compress-{kind}-{inner}", "seed": 5, "workers": WORLD,
            "topology": topology,
            "job": {"model": "mlp", "steps": STEPS, "batch": 32,
                    "optimizer": {"adam": {"lr": 0.01}}},
            "collective": collective, "metrics": {"drift_every": 0}}


@pytest.mark.parametrize(("kind", "inner"), CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_training_converges_with_a_compressor(kind: str, inner: str, tmp_path: Path):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario(kind, inner)))
    runner = ClusterRun(path, run_dir=tmp_path / "run")
    result = runner.run(timeout=240)
    assert result.success, result.error
    evaluations = [w.evaluation for w in runner.workers]
    assert all(e for e in evaluations), evaluations
    losses = [e["loss"] for e in evaluations]
    assert max(losses) < 0.7 * UNTRAINED, losses  # learned (uncompressed: about 0.3)
    if inner != "lossy":  # an exact inner: the same estimate, the same model everywhere
        assert max(losses) - min(losses) < 1e-4, losses
    run = load_run(result.run_dir)
    ratios = run.column("compression_ratio")
    assert len(ratios) == WORLD * STEPS
    if kind in SPARSIFIERS:  # EF21M's first step sends the gradient whole
        first = run.column("step") == 0
        assert (ratios[first] == 1.0).all(), ratios[first]
        ratios = ratios[~first]
    assert (ratios > 0).all() and (ratios < 0.6).all(), ratios
    assert {event.collective for event in run.steps} == {f"{inner}+{kind}"}
    if inner != "gloo":  # gloo's own all-reduce bytes are not ours to count
        assert (run.column("bytes_sent") > 0).all()
