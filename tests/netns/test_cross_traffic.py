"""A scenario's background flows (`traffic:`) in a namespace run: real iperf3 between the
workers' namespaces, over the shaped links, from and until the times the scenario gives; what
they received in the run's records, the receiver's status file and its metrics; nothing of
them left after the run, or after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
from functools import partial
from pathlib import Path

import pytest
from live import ended, start_run, wait_for
from nft_drop import drop, stop_dropping

from netem.lab import lab_namespaces
from testbed.cluster.runner import ClusterRun
from testbed.cluster.traffic import CONNECT_WAIT, CrossTraffic
from testbed.metrics.traffic import TrafficCollector, read_status, status_path
from testbed.report import load_run
from testbed.scenario.traffic import Flow

pytestmark = pytest.mark.netns

TCP_START, TCP_STOP = 0.5, 2.5  # seconds after training started
UDP_RATE = 4_000_000  # bits/s, a tenth of the links' rate: all of it arrives
SCENARIO = f"""
name: traffic
seed: 2
workers: 3
topology:
  default: {{rate: 40mbit}}
job: {{model: mlp, steps: {{steps}}, batch: 32, straggler: {{fixed: 60ms}}}}
collective: {{kind: ring}}
metrics: {{drift_every: 0}}
traffic:
  - {{name: bulk, from: 0, to: 1, kind: tcp, start: {TCP_START}s, stop: {TCP_STOP}s}}
  - {{from: 2, to: 1, kind: udp, rate: {UDP_RATE // 1000}kbit}}
"""


def iperf3_processes(parent: int | None = None) -> set[int]:
    """The iperf3 processes that are children of `parent` (default: this one): a run's, not
    another's running beside it."""
    found = subprocess.run(["pgrep", "-x", "-P", str(parent or os.getpid()), "iperf3"],
                           capture_output=True, text=True)
    return {int(pid) for pid in found.stdout.split()}


def test_flows_run_when_the_scenario_says_and_show_in_the_records_and_metrics(tmp_path: Path):
    scenario = tmp_path / "traffic.yaml"
    scenario.write_text(SCENARIO.replace("{steps}", "80"))  # >= 80 * 60 ms = 4.8 s of training
    result = ClusterRun(scenario, run_dir=tmp_path / "run").run(lambda workers: None)
    assert result.success, result.error

    run = load_run(result.run_dir)
    training = run.training_t
    assert training is not None
    flows = run.traffic()
    assert set(flows) == {"bulk", "2-1-udp"}, flows.keys()
    # The bulk flow: nothing before its start, nothing after its stop. The server's own
    # clock gives each report's span, ending when the report was read (later, never
    # earlier); the client is ended at its stop, so what it sent lasted at most that long
    # (plus the moment a terminated client takes to say so; 1 s is far above it).
    end, seconds, received = flows["bulk"].T
    assert (end - seconds).min() >= training + TCP_START - 0.3, (training, flows["bulk"])
    assert 0.5 <= seconds.sum() <= TCP_STOP - TCP_START + 1.0, seconds
    assert received.sum() > 0
    # The UDP flow ran from the start to the end of the run, after the bulk flow stopped,
    # at its rate: UDP has no congestion control and the link has room for it.
    end, seconds, received = flows["2-1-udp"].T
    assert end.max() > training + TCP_STOP + 1.0
    rate = received.sum() * 8 / seconds.sum()
    assert 0.8 * UDP_RATE < rate < 1.2 * UDP_RATE, rate

    # The receiver's status file says what the records say; its metrics read it.
    status = read_status(status_path(result.run_dir, 1))
    assert {name: flow["peer"] for name, flow in status.items()} == {"bulk": 0, "2-1-udp": 2}
    assert status["bulk"]["received_bytes"] == pytest.approx(flows["bulk"][:, 2].sum())
    assert not any(flow["active"] for flow in status.values())  # the run is over
    samples = {(sample.name, sample.labels["flow"]): sample.value
               for family in TrafficCollector(status_path(result.run_dir, 1), 1).collect()
               for sample in family.samples}
    assert samples[("testbed_traffic_received_bytes_total", "bulk")] == pytest.approx(
        status["bulk"]["received_bytes"])
    assert samples[("testbed_traffic_active", "2-1-udp")] == 0.0
    assert ("testbed_traffic_lost_datagrams_total", "2-1-udp") in samples
    assert ("testbed_traffic_lost_datagrams_total", "bulk") not in samples  # TCP's: none
    (summary,) = [event["flows"] for event in run.other if event["type"] == "cross_traffic"]
    assert summary["bulk"]["restarts"] == 0 and summary["bulk"]["bursts"] == 1

    prefix = next(event for event in run.other if event["type"] == "cluster")["prefix"]
    assert lab_namespaces(prefix) == []
    assert iperf3_processes() == set(), "the run left iperf3 running"


def test_ctrl_c_ends_the_flows_with_the_run(tmp_path: Path):
    """SIGINT while the flows send: the run ends, and with it every iperf3 it started."""
    from pyroute2 import netns

    scenario = tmp_path / "traffic.yaml"
    scenario.write_text(SCENARIO.replace("{steps}", "100000"))
    out = tmp_path / "run"
    events = out / "events.jsonl"
    runner, made = start_run(
        scenario, out, "a background flow's first report",
        lambda: events.exists() and '"type": "traffic"' in events.read_text())
    try:
        flows = iperf3_processes(runner.pid)
        assert len(flows) >= 3, flows  # two servers, and the UDP client at least
        runner.send_signal(signal.SIGINT)
        assert runner.wait(60) == 128 + signal.SIGINT
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    for pid in flows:
        wait_for(f"iperf3 {pid} to end after Ctrl-C", partial(ended, pid), bool, 10.0,
                 every=0.05)
    assert not set(netns.listnetns()) & made, "Ctrl-C left namespaces"


FAILING = f"""
name: traffic-fails
workers: 2
job:
  command: [python, -c,
            "import os, sys, time; time.sleep(3); sys.exit(3 * int(os.environ['RANK']))"]
metrics: {{port: 0}}
traffic:
  - {{from: 0, to: 1, kind: udp, rate: {UDP_RATE // 1000}kbit}}
"""


def test_a_failed_run_ends_its_flows_too(tmp_path: Path):
    """Worker 1's program fails after 3 s, while a flow sends to it: the run fails, and its
    flows' processes are gone with it."""
    scenario = tmp_path / "fails.yaml"
    scenario.write_text(FAILING)
    result = ClusterRun(scenario, run_dir=tmp_path / "run").run(lambda workers: None)
    assert not result.success and "worker 1" in (result.error or ""), result.error
    run = load_run(result.run_dir)
    assert "0-1-udp" in run.traffic(), "the flow never sent: the test shows nothing"
    assert iperf3_processes() == set(), "the failed run left iperf3 running"


def test_a_client_whose_set_up_was_lost_is_ended_and_started_again(make_lab, tmp_path: Path):
    """iperf3 3.12 sends a UDP test's one set-up datagram once and waits for its answer
    forever (a CI run's on/off flow sent nothing for a whole run so, one datagram lost on a 3%
    link). With every UDP datagram into the receiver dropped, the first client never says it
    is connected: it is ended after CONNECT_WAIT and started again, counted in the flow's
    restarts; once the drop is gone, the flow's bytes come."""
    lab = make_lab(2)
    flow = Flow.model_validate({"from": 0, "to": 1, "kind": "udp", "rate": "1mbit"})
    traffic = CrossTraffic({"f": flow}, run_dir=tmp_path,
                           address_of=lambda rank: lab.hosts[rank].address,
                           here=lambda rank: ["ip", "netns", "exec", lab.hosts[rank].netns])
    drop(lab, lab.hosts[1], "udp dport 5201", 100)
    (state,) = traffic.flows
    traffic.start()
    try:
        wait_for("the first client ended and started again", lambda: state.restarts,
                 lambda restarts: restarts >= 1, CONNECT_WAIT + 10, every=0.2)
        stop_dropping(lab, lab.hosts[1])
        wait_for("the flow's bytes at its receiver", lambda: state.received_bytes,
                 lambda received: received > 0, 2 * CONNECT_WAIT + 10, every=0.2)
    finally:
        traffic.stop()
    assert "connected to" in (tmp_path / "logs" / "traffic-f.log").read_text()
