"""The background flows' pure parts: the `traffic:` section's checks, the iperf3 commands, and
the reading of an iperf3 server's reports (lines as iperf3 3.12 prints them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cluster.traffic import (
    FlowState,
    Interval,
    client_argv,
    parse_interval,
    server_argv,
)
from testbed.metrics.traffic import TrafficCollector, read_status, write_status
from testbed.scenario import Scenario
from testbed.scenario.load import ScenarioError, load_scenario
from testbed.scenario.traffic import Flow


def scenario(*flows: str, workers: int = 3) -> str:
    lines = "\n".join(f"  - {flow}" for flow in flows)
    return f"name: t\nworkers: {workers}\ntraffic:\n{lines}\n"


def load(text: str, tmp_path: Path) -> Scenario:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return load_scenario(path)


def test_a_yaml_on_off_flow_loads_with_its_names(tmp_path: Path):
    loaded = load(scenario("{from: 0, to: 1, kind: udp, rate: 20mbit, on: 1s, off: 500ms}",
                           "{from: 2, to: 1, kind: tcp, congestion: bbr, start: 2s, stop: 8s}",
                           "{from: 2, to: 1, kind: tcp}"), tmp_path)
    flows = loaded.flows()
    assert list(flows) == ["0-1-udp", "2-1-tcp-1", "2-1-tcp-2"]
    on_off = flows["0-1-udp"]
    assert (on_off.rate, on_off.on, on_off.off) == (20_000_000, 1.0, 0.5)
    assert flows["2-1-tcp-1"].describe() == "2->1 tcp bbr, 2s to 8s"
    assert "3 background flow(s)" in loaded.summary()


@pytest.mark.parametrize(("flow", "where", "said"), [
    ("{from: 0, to: 0, kind: tcp}", "traffic[0]", "both worker 0"),
    ("{from: 0, to: 3, kind: tcp}", "traffic[0].to", "no worker 3: workers are 0..2"),
    ("{from: 0, to: 1, kind: udp}", "traffic[0]", "needs a rate"),
    ("{from: 0, to: 1, kind: udp, rate: 20}", "traffic[0].rate", "has no unit"),
    ("{from: 0, to: 1, kind: tcp, rate: 1mbit}", "traffic[0]", "rate: UDP's"),
    ("{from: 0, to: 1, kind: udp, rate: 1mbit, congestion: bbr}", "traffic[0]",
     "congestion is TCP's"),
    ("{from: 0, to: 1, kind: udp, rate: 1mbit, on: 1s}", "traffic[0]", "on and off go together"),
    ("{from: 0, to: 1, kind: tcp, start: 5s, stop: 2s}", "traffic[0]", "must come after start"),
    ("{from: 0, to: 1, kind: tcp, congestion: reno}", "traffic[0].congestion", "cubic"),
    ("{from: 0, to: 1, kind: sctp}", "traffic[0].kind", "tcp"),
])
def test_a_bad_flow_is_refused_naming_its_field(tmp_path: Path, flow: str, where: str,
                                               said: str):
    with pytest.raises(ScenarioError) as error:
        load(scenario(flow), tmp_path)
    assert where in str(error.value) and said in str(error.value), str(error.value)


def test_two_flows_of_one_name_are_refused(tmp_path: Path):
    with pytest.raises(ScenarioError, match=r"traffic\[1\]\.name.*already names traffic\[0\]"):
        load(scenario("{name: x, from: 0, to: 1, kind: tcp}",
                      "{name: x, from: 1, to: 0, kind: tcp}"), tmp_path)


def test_the_commands_are_iperf3s_in_kbit_per_second():
    udp = Flow.model_validate({"from": 0, "to": 1, "kind": "udp", "rate": 5_000_000})
    assert server_argv(5202) == ["iperf3", "--server", "--port", "5202", "--interval", "0.1",
                                 "--forceflush", "--format", "k"]
    assert client_argv(udp, "10.0.0.2", 5202) == [
        "iperf3", "--client", "10.0.0.2", "--port", "5202", "--time", "0", "--interval", "0",
        "--format", "k", "--udp", "--bitrate", "5000000"]
    bbr = Flow.model_validate({"from": 0, "to": 1, "kind": "tcp", "congestion": "bbr"})
    argv = client_argv(bbr, "10.0.0.2", 5201, send_bytes=1000)
    assert argv[5:7] == ["--bytes", "1000"] and argv[-2:] == ["--congestion", "bbr"]


TCP_TEST = """\
-----------------------------------------------------------
Server listening on 5201 (test #1)
-----------------------------------------------------------
Accepted connection from 10.9.0.1, port 58560
[  5] local 10.9.0.2 port 5201 connected to 10.9.0.1 port 58562
[ ID] Interval           Transfer     Bitrate
[  5]   0.00-0.50   sec   662 MBytes  8000 Kbits/sec
[  5]   0.50-1.00   sec   553 MBytes  8000 Kbits/sec
[  5]   0.50-1.00   sec   553 MBytes  8000 Kbits/sec
[  5]   1.00-1.20   sec  1.51 MBytes  4000 Kbits/sec
- - - - - - - - - - - - - - - - - - - - - - - - -
[ ID] Interval           Transfer     Bitrate
[  5]   0.00-1.20   sec  1.19 GBytes  7000 Kbits/sec                  receiver
-----------------------------------------------------------
Server listening on 5201 (test #2)
"""
UDP_LINE = ("[  5]   0.50-1.00   sec   611 KBytes  10000 Kbits/sec  0.006 ms  3/432 (0.69%)  ")


def test_a_report_line_is_read_and_the_sums_are_not():
    assert parse_interval(UDP_LINE) == Interval(0.5, 1.0, 625_000.0, 3, 432)
    assert parse_interval("[  5]   0.00-1.20   sec  1.19 GBytes  7000 Kbits/sec    receiver") \
        is None
    assert parse_interval("[ ID] Interval           Transfer     Bitrate") is None
    assert parse_interval("iperf3: the client has terminated") is None


def test_a_servers_output_counts_each_interval_once_and_records_each_second():
    bulk = Flow.model_validate({"from": 2, "to": 1, "kind": "tcp"})
    state = FlowState("bulk", bulk, 5201)
    recorded, active = [], []
    for line in TCP_TEST.splitlines():
        interval = state.take(line)
        active.append(state.active)
        if interval is not None:
            recorded.append(interval)
    # 0.5 + 0.5 s make a record; the repeated line counts once; the rest goes at the test's end.
    assert [(r.start, r.end) for r in recorded] == [(0.0, 1.0), (1.0, 1.2)]
    assert [r.bytes for r in recorded] == pytest.approx([1_000_000.0, 100_000.0])
    assert state.received_bytes == pytest.approx(1_100_000.0)
    assert state.seconds == pytest.approx(1.2)
    assert active[3] and not active[-1] and not active[10]  # on from Accepted to the rule


def test_the_status_file_feeds_the_receivers_metrics(tmp_path: Path):
    path = tmp_path / "logs" / "traffic-1.json"
    flows = {"bulk": {"peer": 0, "kind": "tcp", "active": True, "received_bytes": 1e6,
                      "lost_datagrams": 0},
             "burst": {"peer": 2, "kind": "udp", "active": False, "received_bytes": 5e5,
                       "lost_datagrams": 7}}
    write_status(path, flows)
    assert read_status(path) == flows
    assert read_status(tmp_path / "missing.json") == {}
    samples = {(s.name, s.labels["flow"]): (s.value, s.labels)
               for family in TrafficCollector(path, 1).collect() for s in family.samples}
    assert samples["testbed_traffic_received_bytes_total", "bulk"] == (
        1e6, {"rank": "1", "peer": "0", "flow": "bulk", "kind": "tcp"})
    assert samples["testbed_traffic_active", "bulk"][0] == 1.0
    assert samples["testbed_traffic_lost_datagrams_total", "burst"][0] == 7
    assert ("testbed_traffic_lost_datagrams_total", "bulk") not in samples
