"""`testbed run` of a scenario that authenticates (`security: {authenticate: true}`): the lossy
workers train with the run's key, which lives in a 0600 file of the run directory only while
the run lasts, named by every worker's spec, and is written nowhere else in the run directory
(events, summary, logs, report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster.runner import KEY_FILE, ClusterRun
from testbed.cluster.worker import WorkerSpec

pytestmark = pytest.mark.netns

STEPS = 4
SCENARIO = f"""
name: run-keyed
seed: 5
workers: 3
job: {{model: mlp, steps: {STEPS}, batch: 32}}
collective: {{kind: lossy, resync_every: 2}}
security: {{authenticate: true}}
"""


def test_an_authenticating_run_keeps_its_key_in_one_owner_only_file_while_it_lasts(
        tmp_path: Path):
    scenario = tmp_path / "run-keyed.yaml"
    scenario.write_text(SCENARIO)
    cluster = ClusterRun(scenario, run_dir=tmp_path / "run")
    key_path = cluster.run_dir / KEY_FILE
    seen: dict[str, object] = {}

    def on_update(workers) -> None:  # while the workers run, the key is there
        if key_path.exists() and "key" not in seen:
            seen["mode"] = key_path.stat().st_mode & 0o777
            seen["key"] = key_path.read_bytes()

    result = cluster.run(on_update)
    assert result.success, result.error
    assert all(w.step == STEPS - 1 for w in result.workers)
    assert seen.get("mode") == 0o600 and len(seen.get("key", b"")) == 32, seen.get("mode")
    assert not key_path.exists(), "the key outlived the run"
    key = seen["key"]
    assert isinstance(key, bytes)
    for rank in range(3):
        spec = WorkerSpec.from_json((cluster.run_dir / "logs" / f"worker-{rank}.json").read_text())
        assert spec.key_file == str(key_path.resolve())
    leaks = [path for path in cluster.run_dir.rglob("*") if path.is_file()
             and (key in path.read_bytes() or key.hex().encode() in path.read_bytes())]
    assert not leaks, f"the run's key is written in {leaks}"
