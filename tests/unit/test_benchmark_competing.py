"""The competing-traffic benchmark's pure parts: its scenarios (one shared queue per receiver),
reading a run, the port's classes and the tables."""

from __future__ import annotations

import datetime
import math
from types import SimpleNamespace

import pytest
import yaml

from benchmarks import competing
from benchmarks.competing import CONDITIONS, Outcome
from benchmarks.report import Run
from testbed.scenario.links import LinkState, draws_random
from testbed.scenario.load import load_scenario


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_every_sender_into_the_receiver_shares_one_class(tmp_path, condition):
    """Same profile on every link, nothing random: no link gets a rule (a class) of its own,
    so the flow and the collective meet in the receiver's catch-all queue."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(competing.scenario("ring", CONDITIONS[condition], 10)))
    scenario = load_scenario(path)
    incoming = LinkState.of(scenario).shaped_into(competing.RECEIVER)
    profiles = {p.model_dump_json() for p in incoming.values()}
    assert len(profiles) == 1
    profile = next(iter(incoming.values()))
    assert profile.seed is None and not draws_random(profile)
    assert profile.rate == competing.RATE_BPS and profile.limit == competing.LIMIT
    assert not scenario.timeline
    flows = list(scenario.flows().values())
    assert len(flows) == len(CONDITIONS[condition].flows)
    assert all(f.dst == competing.RECEIVER and f.src == competing.SENDER for f in flows)


def step(t, rank, number, seconds, coverage=1.0):
    return SimpleNamespace(t=t, rank=rank, step=number, allreduce_seconds=seconds,
                           step_seconds=seconds + 0.001, coverage=coverage, bytes_sent=1000)


def test_read_run_leaves_out_the_warm_up_and_sums_the_flow():
    steps = [step(10.2, 0, 0, 5.0), step(11.5, 0, 1, 0.1, 0.9), step(11.6, 1, 1, 0.3, 1.0)]
    other = [{"type": "training", "t": 10.0},
             {"type": "traffic", "t": 11.0, "flow": "2-1-udp", "seconds": 1.0,
              "bytes": 6.25e6, "lost": 3},
             {"type": "traffic", "t": 12.0, "flow": "2-1-udp", "seconds": 1.0,
              "bytes": 6.25e6, "lost": 2},
             {"type": "cross_traffic", "flows": {"2-1-udp": {"restarts": 1}}}]
    run = SimpleNamespace(steps=steps, other=other, training_t=10.0)
    outcome = Outcome("lossy", "udp")
    competing.read_run(outcome, run)
    assert outcome.steps == 2 and outcome.counted == 2
    assert outcome.allreduce == [0.1, 0.3]
    assert outcome.coverage == pytest.approx(0.95) and outcome.coverage_min == 0.9
    assert outcome.flow_mbps == pytest.approx(50.0)
    assert outcome.flow_lost == 5 and outcome.flow_restarts == 1
    assert outcome.training == pytest.approx(1.6)
    assert competing.mean_rate(outcome) == pytest.approx(12.5e6 * 8 / 1.6 / 1e6)


def test_no_traffic_events_no_flow_figures():
    assert all(math.isnan(v) for v in competing.flow_rate([{"type": "training", "t": 1.0}]))


def test_parse_classes_from_tc_text():
    text = (
        "class htb 1:1 root leaf 101: prio 0 rate 100Mbit ceil 100Mbit burst 1600b cburst "
        "1600b \n Sent 3553811 bytes 2600 pkt (dropped 0, overlimits 2303 requeues 0) \n"
        " backlog 0b 0p requeues 0\n\n"
        "class htb 1:2 root leaf 102: prio 0 rate 8Tbit ceil 8Tbit burst 0b cburst 0b \n"
        " Sent 817 bytes 12 pkt (dropped 0, overlimits 0 requeues 0) \n")
    assert competing.parse_classes(text) == {"1:1": ("100Mbit", 3553811),
                                             "1:2": ("8Tbit", 817)}
    assert competing.parse_classes("") == {}


def outcome(collective, condition, seconds):
    return Outcome(collective, condition, status="ok", allreduce=list(seconds))


def test_side_by_side_gives_the_ratio_to_none():
    outcomes = [outcome("ring", "none", [0.010, 0.020, 0.030]),
                outcome("ring", "cubic", [0.100, 0.200, 0.300]),
                Outcome("ring", "bbr", status="timeout")]
    rows = competing.side_by_side(outcomes, ["none", "cubic", "bbr"], 0.5)
    assert rows[0] == "| collective | none | tcp cubic | tcp bbr |"
    assert rows[2] == "| ring (TCP) | 20.0 | 200.0 (10.00×) | timeout |"


def test_port_reading_delay_at_the_link_rate():
    reading = competing.PortReading(backlog=[0.0, 125_000.0, 1_250_000.0])
    assert reading.delay_ms(0.5) == pytest.approx(10.0)  # 125 kB at 100 Mbit/s
    assert math.isnan(competing.PortReading().delay_ms(0.5))


def test_report_is_written_with_every_table(tmp_path):
    run = Run("python -m benchmarks.competing", datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
              0.0)
    path = tmp_path / "out.md"
    outcomes = [outcome("lossy", "none", [0.05]), outcome("lossy", "cubic", [0.2])]
    outcomes[1].coverage, outcomes[1].coverage_min = 0.98, 0.9
    competing.write_report(outcomes, ["none", "cubic"], run, path, total=2, steps=10)
    text = path.read_text()
    assert "| lossy (UDP) | 50.0 | 200.0 (4.00×) |" in text
    assert "0.9800 (min 0.900)" in text
    assert "Partial" not in text

