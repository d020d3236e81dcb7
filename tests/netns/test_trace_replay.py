"""A traced link on the wire: a sender above the trace's peak gets, per second, the capacity the
trace gives, and the replay puts back what the port had. On this kernel (no sch_netem) the
fallback's htb class carries the rate; in the UML guest netem does."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from live import wait_for
from typer.testing import CliRunner

from netem import LinkProfile, apply, show
from netem.namespace import udp_socket_in
from netem.trace import Replay, load_trace, schedule
from testbed.cli import app

pytestmark = pytest.mark.netns
DATA = Path(__file__).parent.parent / "data"
PAYLOAD = 1400
FRAME = PAYLOAD + 8 + 20 + 14  # what the shaper counts: UDP, IPv4 and Ethernet headers
OFFERED = 30e6  # bits/s of frames: above the step trace's 20 Mbit/s
TOLERANCE = 0.10  # of a plateau's capacity


def blast(netns: str, address: tuple[str, int], until: float) -> None:
    """Paced UDP frames at OFFERED until the monotonic time `until`."""
    sock = udp_socket_in(netns)
    payload, sent, start = bytes(PAYLOAD), 0, time.monotonic()
    try:
        while (now := time.monotonic()) < until:
            if sent * FRAME * 8 > OFFERED * (now - start):
                time.sleep(0.0005)
                continue
            with contextlib.suppress(OSError):  # a full queue: counted as not sent
                sock.sendto(payload, address)
            sent += 1
    finally:
        sock.close()


def receive(sock: socket.socket, arrivals: list[float], stop: threading.Event) -> None:
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            sock.recv(2048)
        except TimeoutError:
            continue
        arrivals.append(time.monotonic())


def test_step_trace_capacity_per_second_and_restore(make_lab, measured):
    """Each plateau of the trace, away from its edges (a change lands within a few tens of ms
    on a busy host; the per-second fidelity, edges included, is the benchmark's), carries the
    trace's capacity: 20 Mbit/s, then 5 Mbit/s."""
    lab = make_lab(2)
    a, b = lab.hosts
    before = LinkProfile.parse(rate="50mbit", limit=300)
    apply(b.switch_port, before, netns=lab.switch)
    plan = schedule(load_trace(DATA / "step.csv"))  # 20 Mbit/s for 2 s, then 5 Mbit/s for 2 s
    plateaus = {(0.3, 1.7): 20e6, (2.3, 3.7): 5e6}  # seconds after the replay's start

    receiver = udp_socket_in(b.netns)
    receiver.bind((b.address, 0))
    arrivals: list[float] = []
    stop = threading.Event()
    listening = threading.Thread(target=receive, args=(receiver, arrivals, stop))
    listening.start()
    replay = Replay(b.switch_port, LinkProfile.parse(limit=100), plan, netns=lab.switch,
                    loop=False)
    try:
        sender = threading.Thread(target=blast, args=(a.netns, receiver.getsockname(),
                                                      time.monotonic() + 4.4))
        sender.start()
        replay.start()
        assert replay.wait(timeout=10), "the replay did not end with its trace"
        sender.join()
        wait_for("a frame after the last plateau", lambda: arrivals[-1] if arrivals else 0.0,
                 lambda last: last > replay.origin + 3.8, timeout=10, every=0.05)
    finally:
        stop.set()
        listening.join()
        receiver.close()
        replay.stop()

    stamps = np.array(arrivals) - replay.origin
    got = {span: np.count_nonzero((stamps >= span[0]) & (stamps < span[1])) * FRAME * 8
           / (span[1] - span[0]) for span in plateaus}
    error = {span: abs(got[span] - rate) / rate for span, rate in plateaus.items()}
    late = replay.late
    measured(f"plateaus {', '.join(f'{rate / 1e6:.2f}' for rate in got.values())} Mbit/s "
             f"(trace 20, 5): relative error max {max(error.values()):.3f}; {late.changes} "
             f"change(s) late {late.max * 1000:.2f} ms max, {late.skipped} window(s) skipped")
    assert max(error.values()) < TOLERANCE, got
    assert late.changes == 1
    assert show(b.switch_port, netns=lab.switch) == {None: before}


def test_stop_of_a_looping_replay_leaves_an_unshaped_port_unshaped(make_lab):
    lab = make_lab(1)
    (host,) = lab.hosts
    plan = schedule(load_trace(DATA / "step.mahimahi"), 0.05)
    with Replay(host.switch_port, LinkProfile(), plan, netns=lab.switch) as replay:
        wait_for("a change of the replay", lambda: replay.late.changes, bool, timeout=10,
                 every=0.05)
        assert show(host.switch_port, netns=lab.switch)[None].rate == 12_000_000
        assert not replay.wait(timeout=0)  # a looping trace does not end
    assert show(host.switch_port, netns=lab.switch) == {}
    assert replay.late.changes >= 1


def test_shape_trace_replays_to_the_end_and_restores(make_lab, tmp_path):
    lab = make_lab(1)
    (host,) = lab.hosts
    trace = tmp_path / "steps.csv"
    trace.write_text("time,rate,loss\n0,10mbit,1%\n200ms,5mbit,\n400ms,,\n")
    result = CliRunner().invoke(app, ["shape", host.switch_port, "--netns", lab.switch,
                                      "--trace", str(trace), "--resolution", "50ms",
                                      "--no-loop", "--limit", "100", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["trace"]["windows"] == 8 and report["trace"]["max_rate"] == 10e6
    assert report["late"]["changes"] == 1 and not report["interrupted"]
    assert show(host.switch_port, netns=lab.switch) == {}
