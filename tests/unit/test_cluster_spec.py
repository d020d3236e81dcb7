"""A worker's spec: it round-trips through JSON, bad fields are named, and every collective gets
the placement options its constructor takes. The straggler bursts a worker reads from its
control file: each lasts its steps or its time, and a restarted worker does not replay them;
the faults it reads keep their own times, replayed or not."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest

from testbed import collectives
from testbed.cluster.worker import (
    PORTS,
    SpecError,
    WorkerControl,
    WorkerSpec,
    placement,
    post_fault,
    post_links,
)
from testbed.collectives import registry
from testbed.scenario import load_scenario

HOSTS = ["198.18.0.1", "198.18.0.2", "198.18.0.3"]


def spec(**fields) -> WorkerSpec:
    base = dict(scenario="s.yaml", rank=1, world=3, hosts=HOSTS, run_dir="/tmp/run", run_id=9)
    return WorkerSpec(**{**base, **fields})


def test_round_trips_through_json():
    original = spec(steps=5, port_stride=10, ports={"collective": 31000})
    assert WorkerSpec.from_json(original.to_json()) == original
    assert original.port("collective") == 31010 and original.port("collective", 2) == 31020
    assert original.port("metrics") == PORTS["metrics"] + 10


@pytest.mark.parametrize(("text", "message"), [
    ('{"rank": 0}', "required"),
    ('{"scenario": "s", "rank": 3, "world": 3, "hosts": ["a", "b", "c"], "run_dir": "r"}',
     "rank: expected 0..2"),
    ('{"scenario": "s", "rank": 0, "world": 2, "hosts": ["a"], "run_dir": "r"}',
     "hosts: expected one address per rank"),
    ('{"scenario": "s", "rank": 0, "world": 1, "hosts": ["a"], "run_dir": "r", "prots": {}}',
     "prots: not a field"),
    ('{"scenario": "s", "rank": 0, "world": 1, "hosts": ["a"], "run_dir": "r", '
     '"ports": {"gossip": 1}}', "ports: unknown gossip"),
    ("[1, 2]", "expected a JSON object"),
    ("{", "not JSON"),
])
def test_bad_specs_name_the_field(text, message):
    with pytest.raises(SpecError, match=message):
        WorkerSpec.from_json(text)


@pytest.mark.parametrize("kind", registry.kinds())
def test_placement_gives_each_collective_options_it_takes(kind):
    scenario = load_scenario(f"name: p\nworkers: 3\ncollective: {{kind: {kind}}}\n"
                             "topology: {mtu: 9000, congestion: bbr}\n")
    options = registry.kind(kind).place(placement(spec(), scenario))
    accepted = inspect.signature(collectives.implementation(kind)).parameters
    assert set(options) <= set(accepted), f"{kind} takes no {set(options) - set(accepted)}"
    assert not set(options) & set(registry.kind(kind).options.model_fields), (
        "a scenario option is also a placement one")
    if "addresses" in options:
        assert options["addresses"][2] == (HOSTS[2], PORTS["collective"])
    if kind == "lossy":
        assert options["mtu"] == 9000 and options["congestion"] == "bbr"


def test_bursts_from_the_control_file_last_their_steps_or_their_time(tmp_path: Path):
    control = tmp_path / "control-0.jsonl"
    bursts = WorkerControl(control, seed=1, rank=0)

    def delay() -> float:
        bursts.poll()
        return bursts.delay()

    assert delay() == 0.0  # no file yet
    with control.open("a") as file:
        file.write(json.dumps({"delay": {"fixed": 0.2}, "steps": 2, "until": None}) + "\n")
        file.write(json.dumps({"delay": {"fixed": 0.05}, "steps": None,
                               "until": time.time() + 3600}) + "\n")
        file.write('{"delay": {"fixed": 9')  # a line still being written is not read yet
    assert [delay() for _ in range(3)] == pytest.approx([0.25, 0.25, 0.05])
    with control.open("a") as file:
        file.write('}, "steps": 1, "until": null}\n')
    assert delay() == pytest.approx(9.05)
    assert delay() == pytest.approx(0.05)

    restarted = WorkerControl(control, seed=1, rank=0)
    restarted.poll()
    assert restarted.delay() == 0.0, "a restarted worker replayed old bursts"
    with control.open("a") as file:
        file.write(json.dumps({"delay": {"fixed": 0.1}, "steps": None,
                               "until": time.time() - 1}) + "\n")
    restarted.poll()
    assert restarted.delay() == 0.0, "a burst whose time is over still applied"


def test_link_changes_reach_the_worker_and_a_restarted_one_takes_the_latest(tmp_path: Path):
    from netem.profile import LinkProfile

    seen: list[tuple[int, LinkProfile | None]] = []
    control = WorkerControl(tmp_path / "logs" / "control-1.jsonl", seed=1, rank=1,
                            on_link=lambda peer, profile: seen.append((peer, profile)))
    lossy, cut = LinkProfile(loss=0.3), LinkProfile(loss=1.0)
    profiles = {(0, 1): lossy, (2, 1): cut, (1, 2): cut}
    record = {"action": "set_link", "pairs": [[0, 1], [2, 1], [1, 2]]}
    post_links(tmp_path, record, lambda src, dst: profiles[(src, dst)])
    assert seen == []  # read before the next step, not at once
    control.poll()
    assert seen == [(0, lossy), (2, cut)]  # 1->2 is worker 2's to know
    assert control.delay() == 0.0

    profiles[(0, 1)] = LinkProfile(loss=0.05)
    post_links(tmp_path, {"pairs": [[0, 1]]}, lambda src, dst: profiles[(src, dst)])
    again: list[tuple[int, LinkProfile | None]] = []
    WorkerControl(tmp_path / "logs" / "control-1.jsonl", seed=1, rank=1,
                  on_link=lambda peer, profile: again.append((peer, profile)))
    assert again[-2:] == [(2, cut), (0, LinkProfile(loss=0.05))]


class _Network:
    """What `ClusterRun._write_specs` reads of a built network."""

    hosts = HOSTS
    control_address = "198.18.0.254"

    def namespace(self, worker: int) -> str:
        return f"tb-test-h{worker}"


@pytest.mark.parametrize("authenticate", ["true", "auto"])
def test_a_run_that_authenticates_hands_workers_its_key_in_a_file_only_they_read(
        tmp_path: Path, authenticate: str):
    """In namespaces `auto` is off; `true` makes a key per run, in a 0600 file the specs name:
    the key itself is in no spec, and each worker's placement carries it."""
    from testbed.cluster.runner import KEY_FILE, ClusterRun

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 3\ncollective: {kind: lossy}\n"
                    f"security: {{authenticate: {authenticate}}}\n")
    run = ClusterRun(path, run_dir=tmp_path / "run")
    (run.run_dir / "logs").mkdir(parents=True)
    run._write_specs(_Network())
    key_path = run.run_dir / KEY_FILE
    specs = [WorkerSpec.from_json(run._spec_path(rank).read_text()) for rank in range(3)]
    if authenticate == "auto":
        assert not key_path.exists() and all(s.key_file is None for s in specs)
        assert placement(specs[0], run.scenario).key is None
        return
    assert key_path.stat().st_mode & 0o777 == 0o600
    key = key_path.read_bytes()
    for rank, each in enumerate(specs):
        text = run._spec_path(rank).read_bytes()
        assert key not in text and key.hex().encode() not in text
        assert each.key_file == str(key_path.resolve())
        assert placement(each, run.scenario).key == key


def test_faults_reach_every_worker_named_with_their_own_time(tmp_path: Path):
    seen: dict[int, list[tuple[str, str, float]]] = {0: [], 1: []}
    controls = [WorkerControl(tmp_path / "logs" / f"control-{rank}.jsonl", seed=1, rank=rank,
                              on_fault=lambda *fault, r=rank: seen[r].append(fault))
                for rank in seen]
    records = [
        {"action": "set_link", "link": "0<->1", "pairs": [[0, 1], [1, 0]]},
        {"action": "partition", "link": "east|west", "pairs": []},
        {"action": "kill", "workers": [2, 3], "rank": [2, 3]},
        {"action": "straggler_burst", "workers": [1], "rank": [1]},
        {"action": "restart", "workers": [2], "error": "RuntimeError: no handler"},  # not one
    ]
    for when, record in enumerate(records, start=100):
        post_fault(tmp_path, record, float(when), [0, 1])
    post_fault(tmp_path, {"action": "heal", "link": "all links"}, 200.0, [1])
    expected = [("set_link", "0<->1", 100.0), ("partition", "east|west", 101.0),
                ("kill", "2,3", 102.0), ("straggler_burst", "1", 103.0)]
    for control in controls:
        control.poll()
    assert seen[0] == expected
    assert seen[1] == [*expected, ("heal", "all links", 200.0)]
    replayed: list[tuple[str, str, float]] = []
    WorkerControl(tmp_path / "logs" / "control-0.jsonl", seed=1, rank=0,
                  on_fault=lambda *fault: replayed.append(fault))
    assert replayed == expected  # a restarted worker: the same facts, at their own times
