"""A Compose node's own fault timeline tells its metrics about every event it applied (its own
control file, as the namespace runner tells every worker), restarts included, but not the
events a restarted node replays to catch up: they happened while it was away. No container:
the node's links are never started, and the run's store is a dict."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster.node import ORIGIN_KEY, Node
from testbed.cluster.worker import WorkerControl

SCENARIO = """
name: node-faults
workers: 3
job: {model: mlp, steps: 10}
collective: {kind: moshpit}
security: {authenticate: false}  # the faults, not the key, are what is checked here
timeline:
  - {step: 2, set_link: {link: {between: [0, 1]}, profile: {loss: 30%}}}
  - {step: 3, kill: 2}
  - {step: 5, restart: 2}
  - {step: 6, straggler_burst: {workers: [1], delay: {fixed: 10ms}, steps: 1}}
"""


class Store:
    """The calls a node makes on the run's TCPStore, on a dict."""

    def __init__(self, **values: object) -> None:
        self.values = {key: str(value).encode() for key, value in values.items()}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.values.get(key, b"").decode() == expected:
            self.values[key] = desired.encode()
        return self.values[key]

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)


def faults_posted(tmp_path: Path, rank: int, *, rejoin: bool, store: Store,
                  steps: range) -> list[str]:
    """What node `rank` posted to its control file for its metrics, as `action target`."""
    path = tmp_path / "scenario.yaml"
    path.write_text(SCENARIO)
    node = Node(path, rank, ["198.18.0.1", "198.18.0.2", "198.18.0.3"], tmp_path)
    node._client, node.run_dir, node._rejoin = store, tmp_path, rejoin
    node._start_timeline()
    try:
        for step in steps:
            node._before_step(step)
    finally:
        node._timeline.stop()
    assert not node._timeline.errors, node._timeline.errors
    seen: list[str] = []
    WorkerControl(tmp_path / "logs" / f"control-{rank}.jsonl", seed=1, rank=rank,
                  on_fault=lambda action, target, when: seen.append(f"{action} {target}"))
    return seen


def test_a_node_posts_every_event_it_applied(tmp_path: Path):
    posted = faults_posted(tmp_path, 1, rejoin=False, store=Store(), steps=range(10))
    assert posted == ["set_link 0<->1", "kill 2", "restart 2", "straggler_burst 1"]


@pytest.mark.parametrize(("rank", "progress", "expected"), [
    # Worker 2, back after its kill: the link change was before; its own kill and restart are
    # not its timeline's to run (docs/compose.md); the burst comes after.
    (2, 5, ["straggler_burst 1"]),
    (1, 0, ["set_link 0<->1", "kill 2", "restart 2", "straggler_burst 1"]),  # nothing missed
])
def test_a_rejoining_node_leaves_out_what_it_replays(tmp_path: Path, rank: int, progress: int,
                                                     expected: list[str]):
    store = Store(**{ORIGIN_KEY: 1.0, **{f"progress/{r}": progress for r in range(3)}})
    posted = faults_posted(tmp_path, rank, rejoin=True, store=store,
                           steps=range(progress + 1, 10))
    assert posted == expected
