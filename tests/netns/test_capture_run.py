"""Captures of a real run (`ClusterRun` across namespaces on the host kernel, the fallback's
loss): a program of the user's own sends numbered UDP datagrams and a TCP stream from worker 0
to worker 1 over a link that loses 10%; the link's two pcap files open with scapy, hold only
that link's frames, and the summary's losses are exactly what the received file lacks, as many
as 10% loss makes likely; TCP retransmitted; a size limit cuts the files and says so; Ctrl-C
leaves whole files and a summary."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
from live import start_run
from scapy.layers.inet import IP, UDP
from scapy.utils import PcapReader
from typer.testing import CliRunner

from netem.lab import lab_namespaces
from testbed.cli import app
from testbed.cluster.runner import ClusterRun

pytestmark = pytest.mark.netns
DATAGRAMS = 2000
STREAM = 400_000  # bytes of the TCP stream: about 280 segments
LOSS = 0.10
A, B = "198.18.0.1", "198.18.0.2"

PROGRAM = """
import os, socket, sys, time
rank = int(os.environ["RANK"])
hosts = os.environ["TESTBED_ADDRESSES"].split(",")
count, size, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
if rank == 0:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end = time.time() + seconds
    i = 0
    while i < count or time.time() < end:
        udp.sendto(i.to_bytes(4, "big") * 100, (hosts[1], 6000))  # datagram i, 400 bytes
        i += 1
        if i % 50 == 0:
            time.sleep(0.005)  # paced: nothing is dropped before the link
    deadline = time.time() + 60
    while True:
        try:
            stream = socket.create_connection((hosts[1], 6001), timeout=5)
            break
        except OSError:
            assert time.time() < deadline, "worker 1 never listened"
            time.sleep(0.1)
    stream.sendall(b"t" * size)
    stream.close()
else:
    server = socket.create_server((hosts[1], 6001))
    back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(50):
        back.sendto(b"back", (hosts[0], 6002))  # on 1->0, which is not captured
    conn, _ = server.accept()
    got = 0
    while data := conn.recv(1 << 16):
        got += len(data)
    assert got == size, got
"""


def scenario(tmp_path: Path, *, count: int, size: int, seconds: float = 0.0,
             capture: str = '{links: ["0->1"]}') -> Path:
    (tmp_path / "program.py").write_text(PROGRAM)
    path = tmp_path / "scenario.yaml"
    path.write_text(f"""
name: capture
workers: 2
topology:
  links: [{{from: 0, to: 1, profile: {{loss: {LOSS:.0%}}}}}]
job:
  command: [python, program.py, "{count}", "{size}", "{seconds}"]
capture: {capture}
""")
    return path


def binomial_bounds(n: int, p: float, odds: float) -> tuple[int, int]:
    """[lo, hi] such that a Binomial(n, p) count falls outside with probability below `odds`
    (half in each tail), from the exact distribution."""
    def pmf(k: int) -> float:
        return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                        + k * math.log(p) + (n - k) * math.log(1 - p))

    lo, tail = 0, 0.0
    while tail + pmf(lo) < odds / 2:
        tail += pmf(lo)
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf(hi) < odds / 2:
        tail += pmf(hi)
        hi -= 1
    return lo, hi


def datagram_numbers(path: Path) -> list[int]:
    with PcapReader(str(path)) as reader:
        return [int.from_bytes(bytes(frame[UDP].payload)[:4], "big")
                for frame in reader if UDP in frame and frame[UDP].dport == 6000]


def test_a_runs_lossy_link_is_captured_at_both_ends_and_summarised(tmp_path: Path):
    run = tmp_path / "run"
    result = ClusterRun(scenario(tmp_path, count=DATAGRAMS, size=STREAM), run_dir=run).run()
    assert result.success, result.error
    capture = run / "capture"
    # Only the captured link, 0->1: its two files, the record and the summary.
    assert sorted(p.name for p in capture.iterdir()) == [
        "0-1.received.pcap", "0-1.sent.pcap", "capture.json", "flows.json"]
    for name in ("0-1.sent.pcap", "0-1.received.pcap"):
        with PcapReader(str(capture / name)) as reader:
            frames = list(reader)
        assert frames and all((f[IP].src, f[IP].dst) == (A, B) for f in frames), name

    flows = json.loads((capture / "flows.json").read_text())
    (link,) = flows["links"]
    assert link["link"] == "0->1" and link["complete"] is True
    assert link["kernel_drops"] == {"sent": 0, "received": 0}
    by_kind = {(f["protocol"], f["dport"]): f for f in link["flows"]}
    datagrams, stream = by_kind["udp", 6000], by_kind["tcp", 6001]

    # Every datagram went on the wire; what the summary calls lost is exactly what the
    # received file lacks (read here with scapy, frame by frame)...
    sent = datagram_numbers(capture / "0-1.sent.pcap")
    received = datagram_numbers(capture / "0-1.received.pcap")
    assert sent == list(range(DATAGRAMS)) and datagrams["sent_packets"] == DATAGRAMS
    missing = len(set(sent) - set(received))
    assert datagrams["lost"] == missing == DATAGRAMS - datagrams["received_packets"]
    assert datagrams["duplicated"] == datagrams["unmatched"] == 0
    # ...and as many as 10% random loss gives: outside these bounds with odds below 1e-6 (the
    # exact binomial tails of 2000 datagrams at p = 0.1: [138, 269] around the mean 200).
    lo, hi = binomial_bounds(DATAGRAMS, LOSS, 1e-6)
    assert lo <= missing <= hi, (missing, lo, hi)

    # TCP resent what the link dropped (P(no segment lost of ~280) = 0.9^280, about 1e-13).
    assert stream["retransmitted"] > 0 and stream["lost"] > 0
    assert stream["sent_bytes"] > STREAM

    summary = json.loads((run / "summary.json").read_text())
    assert summary["capture"]["links"][0]["lost"] == link["totals"]["lost"]
    assert "<h2>Capture</h2>" in (run / "index.html").read_text()
    again = CliRunner().invoke(app, ["capture", str(run), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["links"][0]["totals"] == link["totals"]
    table = CliRunner().invoke(app, ["capture", str(run)])
    assert table.exit_code == 0 and "udp" in table.output and "tcp" in table.output


def test_a_size_limit_cuts_the_files_and_the_summary_says_so(tmp_path: Path):
    run = tmp_path / "run"
    path = scenario(tmp_path, count=300, size=20_000,
                    capture='{links: ["0->1"], max_bytes: 4kB, snap: 96}')
    result = ClusterRun(path, run_dir=run).run()
    assert result.success, result.error
    capture = run / "capture"
    for side in ("sent", "received"):
        size = (capture / f"0-1.{side}.pcap").stat().st_size
        assert 3000 < size <= 4000, (side, size)
        with PcapReader(str(capture / f"0-1.{side}.pcap")) as reader:
            assert all(len(bytes(frame)) <= 96 for frame in reader)
    manifest = json.loads((capture / "capture.json").read_text())
    sent = manifest["links"][0]["sent"]
    assert sent["truncated"] is True and sent["seen"] > sent["packets"] > 0
    flows = json.loads((capture / "flows.json").read_text())
    assert flows["truncated"] is True and flows["links"][0]["complete"] is False
    assert flows["links"][0]["truncated"] == {"sent": True, "received": True}
    table = CliRunner().invoke(app, ["capture", str(run)])
    assert "file cut at 4000 bytes" in table.output


def test_ctrl_c_leaves_whole_files_and_a_summary(tmp_path: Path):
    path = scenario(tmp_path, count=0, size=1000, seconds=600.0, capture="{links: []}")
    out = tmp_path / "run"
    orphans = set(lab_namespaces(orphans_only=True))
    received = out / "capture" / "0-1.received.pcap"
    runner, _ = start_run(path, out, f"over 10 kB in {received}",
                          lambda: received.exists() and received.stat().st_size > 10_000,
                          "--capture", "0->1")
    try:
        runner.send_signal(signal.SIGINT)
        assert runner.wait(60) == 130
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    manifest = json.loads((out / "capture" / "capture.json").read_text())
    (link,) = manifest["links"]
    for side in ("sent", "received"):
        with PcapReader(str(out / "capture" / f"0-1.{side}.pcap")) as reader:
            frames = sum(1 for _ in reader)  # whole: every record reads
        assert frames == link[side]["packets"] > 0 and link[side]["error"] is None
    flows = json.loads((out / "capture" / "flows.json").read_text())
    assert flows["links"][0]["totals"]["sent_packets"] == link["sent"]["packets"]
    assert set(lab_namespaces(orphans_only=True)) <= orphans, "the run left namespaces"
