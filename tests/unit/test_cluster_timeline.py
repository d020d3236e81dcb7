"""The fault timeline against a fake network and a fake clock: no root, no namespaces."""

from __future__ import annotations

import threading
import time

import pytest

from netem.profile import LinkProfile, derive_seed
from testbed.cluster.shaped import ShapedNetwork
from testbed.cluster.timeline import Timeline
from testbed.report.writer import RunWriter
from testbed.scenario import CUT, LinkState, load_scenario


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeNetwork(ShapedNetwork):
    """The real link state with a kernel that only records which links it was asked to shape."""

    def __init__(self, scenario) -> None:
        super().__init__(LinkState.of(scenario))
        self.shaped: list[set[tuple[int, int]]] = []

    def shape(self, touched):
        self.shaped.append(set(touched))
        return 0.001

    @property
    def profiles(self):
        count = self.links.count
        return {(s, d): self.links.current(s, d)
                for s in range(count) for d in range(count) if s != d}

    @property
    def cut(self):
        return self.links.cut


SCENARIO = """
name: timeline
workers: 4
topology:
  default: {loss: 1%}
  groups: {east: [0, 1], west: [2, 3]}
job: {steps: 100}
collective: {kind: moshpit}
timeline:
  - {at: 2s, set_link: {link: {from: 0, to: 1}, profile: {loss: 5%}}, note: worse}
  - {at: 1s, set_link: {link: {between: [east, west]}, profile: {rate: 10mbit}}}
  - at: 10s
    ramp_link: {link: {from: 2, to: 3}, from: {loss: 0%}, to: {loss: 20%}, over: 4s, every: 1s}
  - {at: 20s, partition: [east, west]}
  - {at: 25s, set_link: {link: {from: 0, to: 2}, profile: {loss: 3%}}}
  - {at: 30s, heal: all}
  - {step: 5, kill: [3]}
  - {step: 8, restart: [3]}
  - {step: 9, straggler_burst: {workers: [1], delay: {fixed: 200ms}, steps: 3}}
"""


@pytest.fixture
def setup():
    scenario = load_scenario(SCENARIO)
    clock, network, records = FakeClock(), FakeNetwork(scenario), []
    calls: list[tuple[str, object]] = []
    timeline = Timeline(
        scenario.timeline, network, records.append, clock=clock,
        on_kill=lambda w: calls.append(("kill", w)),
        on_restart=lambda w: calls.append(("restart", w)),
        on_straggler_burst=lambda e: calls.append(("burst", e.straggler_burst.workers)),
    )
    timeline.start(thread=False)
    return scenario, clock, network, records, calls, timeline


def advance(clock, timeline, to):
    clock.t = 100.0 + to
    timeline.poll()


def test_time_events_run_in_time_order_once_due(setup):
    _, clock, network, records, _, timeline = setup
    assert timeline.poll() == pytest.approx(1.0)
    assert records == []
    advance(clock, timeline, 1.5)
    assert [r["action"] for r in records] == ["set_link"]
    assert records[0]["link"] == "east<->west"
    assert network.profiles[(0, 2)] == LinkProfile.parse(loss="1%", rate="10mbit")
    assert network.profiles[(0, 1)] == LinkProfile.parse(loss="1%")
    advance(clock, timeline, 2.0)
    assert records[1]["action"] == "set_link" and records[1]["note"] == "worse"
    assert records[1]["set"] == {"loss": "5%"} and records[1]["pairs"] == [[0, 1]]


def test_lateness_is_recorded(setup):
    _, clock, _, records, _, timeline = setup
    advance(clock, timeline, 2.25)  # both set_links were due, one 1.25 s ago
    first, second = records
    assert (first["scheduled"], first["t"], first["late"]) == (1.0, 2.25, 1.25)
    assert (second["scheduled"], second["late"]) == (2.0, 0.25)
    assert first["at"] == 1.0 and "description" in first


def test_ramp_applies_each_step(setup):
    _, clock, network, records, _, timeline = setup
    for t in (2, 10, 11, 12, 12.5, 13, 14, 15):
        advance(clock, timeline, t)
    ramp = [r for r in records if r["action"] in ("ramp_link", "ramp_step")]
    assert [r["elapsed"] for r in ramp] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [r["profiles"]["2->3"].get("loss", "0%") for r in ramp] == [
        "0%", "5%", "10%", "15%", "20%"]
    assert all(r["late"] == 0 for r in ramp)
    assert network.profiles[(2, 3)].loss == pytest.approx(0.20)
    assert timeline.poll() == pytest.approx(5.0)  # next: the partition at 20 s


def test_partition_and_heal_bookkeeping(setup):
    _, clock, network, records, _, timeline = setup
    advance(clock, timeline, 20)
    cut = {(s, d) for s in (0, 1) for d in (2, 3)} | {(d, s) for s in (0, 1) for d in (2, 3)}
    assert network.cut == cut
    assert records[-1]["action"] == "partition" and len(records[-1]["pairs"]) == 8
    advance(clock, timeline, 25)  # a set_link on a cut link: remembered, still cut
    assert network.profiles[(0, 2)].loss == pytest.approx(0.03) and (0, 2) in network.cut
    advance(clock, timeline, 30)
    assert network.cut == set()
    assert records[-1]["action"] == "heal" and len(records[-1]["pairs"]) == 8
    assert timeline.pending == 3  # the step events


def test_every_change_gives_the_kernel_the_links_seed(setup):
    """The scenario's seed (0 here, by default) seeds every link that draws random numbers,
    through each change: netem re-seeds at random on a change that carries none."""
    _, clock, network, _, _, timeline = setup
    links = network.links

    def seed(src, dst):
        return derive_seed(0, src, dst)

    assert links.shaped(0, 1) == LinkProfile.parse(loss="1%", seed=seed(0, 1))
    advance(clock, timeline, 2)  # set_link 0->1
    assert links.shaped(0, 1) == LinkProfile.parse(loss="5%", seed=seed(0, 1))
    assert links.shaped(0, 2) == LinkProfile.parse(loss="1%", rate="10mbit", seed=seed(0, 2))
    advance(clock, timeline, 12)  # halfway through the ramp of 2->3
    assert links.shaped(2, 3) == LinkProfile.parse(loss="10%", seed=seed(2, 3))
    advance(clock, timeline, 20)  # the partition: cut links carry their seed too
    assert links.shaped(0, 2) == CUT.model_copy(update={"seed": seed(0, 2)})
    advance(clock, timeline, 30)  # the heal: the profile set meanwhile, with its seed
    assert links.shaped(0, 2) == LinkProfile.parse(loss="3%", rate="10mbit", seed=seed(0, 2))
    assert network.profiles[(0, 2)].seed is None  # the profile itself has none of its own


def test_heal_of_one_partition_keeps_links_another_still_cuts():
    scenario = load_scenario("""
workers: 4
topology: {groups: {a: [0], b: [1], c: [2, 3]}}
timeline:
  - {at: 1s, partition: a}
  - {at: 2s, partition: [a, b]}
  - {at: 3s, heal: [a, b]}
  - {at: 4s, heal: all}
""")
    clock, network, records = FakeClock(), FakeNetwork(scenario), []
    timeline = Timeline(scenario.timeline, network, records.append, clock=clock)
    timeline.start(thread=False)
    advance(clock, timeline, 3)
    assert (0, 1) in network.cut and (1, 0) in network.cut  # `a` alone still cuts them
    assert network.shaped[-1] == set()  # the heal of [a, b] restored nothing
    advance(clock, timeline, 4)
    assert network.cut == set()


def test_step_events_fire_on_step(setup):
    _, _, _, records, calls, timeline = setup
    timeline.on_step(4)
    assert calls == []
    timeline.on_step(9)  # steps 5, 8 and 9 all due: in order
    assert calls == [("kill", [3]), ("restart", [3]), ("burst", [1])]
    assert [r["action"] for r in records] == ["kill", "restart", "straggler_burst"]
    assert records[0]["step"] == 5 and records[0]["workers"] == [3]
    timeline.on_step(9)
    assert len(calls) == 3


def test_missing_handler_and_failures_are_reported_not_raised():
    scenario = load_scenario("""
workers: 2
job: {steps: 10}
timeline:
  - {step: 1, kill: 1}
  - {at: 0s, set_link: {profile: {loss: 5%}}}
""")
    network = FakeNetwork(scenario)

    def refuse(touched):
        raise RuntimeError("the kernel said no")

    network.shape = refuse
    records: list[dict] = []
    timeline = Timeline(scenario.timeline, network, records.append, clock=FakeClock())
    timeline.start(thread=False)
    timeline.poll()
    timeline.on_step(1)
    assert len(records) == 2 and len(timeline.errors) == 2
    assert "kernel said no" in records[0]["error"] and "on_kill" in records[1]["error"]


def test_records_fit_the_run_writer(tmp_path, setup):
    _, clock, _, records, _, timeline = setup
    advance(clock, timeline, 12)
    timeline.on_step(9)
    writer = RunWriter.create(tmp_path / "run", scenario=SCENARIO, name="timeline")
    for record in records:
        writer.fault(**record)
    writer.close()
    from testbed.report.run import load_run

    run = load_run(tmp_path / "run")
    assert [f.action for f in run.faults] == [r["action"] for r in records]
    assert run.faults[0].scheduled == 1.0


def test_offset_moves_times_onto_the_run_axis():
    scenario = load_scenario("workers: 2\ntimeline: [{at: 1s, set_link: {profile: {loss: 2%}}}]")
    clock, records = FakeClock(), []
    timeline = Timeline(scenario.timeline, FakeNetwork(scenario), records.append, clock=clock)
    timeline.start(offset=5.0, thread=False)
    advance(clock, timeline, 1.0)
    assert (records[0]["scheduled"], records[0]["t"], records[0]["late"]) == (6.0, 6.0, 0.0)


def test_the_scheduler_thread_runs_on_time_and_stops_promptly():
    scenario = load_scenario("""
workers: 2
timeline:
  - {at: 0.05s, set_link: {profile: {loss: 2%}}}
  - {at: 3600s, set_link: {profile: {loss: 3%}}}
""")
    done = threading.Event()
    records: list[dict] = []

    def on_event(record):
        records.append(record)
        done.set()

    timeline = Timeline(scenario.timeline, FakeNetwork(scenario), on_event)
    timeline.start()
    assert done.wait(5), "the first event never ran"
    assert records[0]["late"] < 0.5  # generous: a benchmark may share the CPU
    began = time.monotonic()
    assert timeline.stop(timeout=2.0)
    assert time.monotonic() - began < 1.0
    assert len(records) == 1
