"""Captures without root: the per-flow analysis of a link's two pcap files (built with scapy
here: what was lost, retransmitted, reordered, duplicated, changed on the way), the bounded
writer, the taps' threads and files on the way out."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
from live import wait_for
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import PcapReader, wrpcap

from netem.capture import (
    BoundedPcap,
    Endpoint,
    LinkCapture,
    Tap,
    analyse,
    analyse_link,
    link_filter,
    read_frames,
)
from netem.units import format_size, parse_size

A, B = "198.18.0.1", "198.18.0.2"
T0 = 1_700_000_000.0


def udp(i: int, *, sport: int = 4000, ttl: int = 64) -> Ether:
    """Datagram i of a flow: IP id 0, as Linux sends unconnected UDP with DF set, so only the
    payload tells two apart."""
    return (Ether() / IP(src=A, dst=B, id=0, flags="DF", ttl=ttl)
            / UDP(sport=sport, dport=5000) / struct.pack(">I", i).ljust(200, b"."))


def tcp(seq: int, size: int, ip_id: int, *, flags: str = "A") -> Ether:
    return (Ether() / IP(src=A, dst=B, id=ip_id, flags="DF")
            / TCP(sport=40000, dport=5001, seq=seq, flags=flags) / (b"d" * size))


def write(path: Path, frames: list[Ether], start: float = T0, step: float = 0.001) -> Path:
    for k, frame in enumerate(frames):
        frame.time = start + k * step
    wrpcap(str(path), frames)
    return path


def flows_by_protocol(result: dict) -> dict:
    return {(f["protocol"], f["sport"]): f for f in result["flows"]}


def test_lost_reordered_duplicated_and_changed_datagrams_are_counted(tmp_path: Path):
    sent = [udp(i) for i in range(100)]
    lost = {5, 17, 18, 40, 77}
    received = [udp(i, ttl=63) for i in range(100) if i not in lost]  # a TTL a router lowered
    received[10], received[11] = received[11], received[10]  # one overtakes another
    received.insert(30, udp(30, ttl=63))  # a copy of 30 arrives before 30 itself
    changed = bytearray(bytes(udp(90)))
    changed[-1] ^= 0x01  # a flipped bit (netem's corrupt): not 90 any more
    received[received.index(next(f for f in received if bytes(f[UDP].payload)[:4] ==
                                 struct.pack(">I", 90)))] = Ether(bytes(changed))
    received.append(Ether() / IP(src=A, dst=B) / ICMP())
    sent.append(Ether() / IP(src=A, dst=B) / ICMP())
    result = analyse_link(read_frames(write(tmp_path / "s.pcap", sent)),
                          read_frames(write(tmp_path / "r.pcap", received, start=T0 + 0.01)),
                          origin=T0)
    flows = flows_by_protocol(result)
    datagrams = flows["udp", 4000]
    assert datagrams["sent_packets"] == 100 and datagrams["received_packets"] == 96
    assert datagrams["lost"] == len(lost) + 1  # 90 never arrived as sent
    assert datagrams["unmatched"] == 1  # what arrived instead
    assert datagrams["duplicated"] == 1
    # The first of two identical frames is the one matched (the copy, in place), so only the
    # swapped pair is out of order: 10 arrived after 11.
    assert datagrams["reordered"] == 1
    assert datagrams["retransmitted"] == 0
    assert datagrams["sent_bytes"] == 100 * len(udp(0))
    assert datagrams["delay_seconds"]["median"] == pytest.approx(0.01, abs=0.005)
    assert datagrams["first_t"] == pytest.approx(0.0, abs=1e-6)
    other = flows["other", 0]
    assert (other["sent_packets"], other["received_packets"], other["lost"]) == (1, 1, 0)
    assert result["totals"]["lost"] == len(lost) + 1 and result["totals"]["flows"] == 2
    assert result["complete"] is True


def test_tcp_retransmissions_are_seen_on_the_senders_side(tmp_path: Path):
    isn = 2**32 - 3000  # the sequence numbers wrap during the flow
    sent = [tcp(isn, 0, 1, flags="S")]
    segments = [(isn + 1 + k * 1000) % 2**32 for k in range(10)]
    ip_id = 2
    for seq in segments:
        sent.append(tcp(seq, 1000, ip_id))
        ip_id += 1
    for seq in (segments[3], segments[3], segments[7]):  # 3 sent again, twice; 7 once
        sent.append(tcp(seq, 1000, ip_id))  # a new IP id: a new frame on the wire
        ip_id += 1
    sent.append(tcp(isn, 0, ip_id, flags="S"))  # the SYN once more
    received = [f for k, f in enumerate(sent) if k not in (4, 8, 11)]  # originals of 3, 7
    result = analyse_link(read_frames(write(tmp_path / "s.pcap", sent)),
                          read_frames(write(tmp_path / "r.pcap", received)))
    (flow,) = result["flows"]
    assert flow["protocol"] == "tcp" and (flow["sport"], flow["dport"]) == (40000, 5001)
    assert flow["retransmitted"] == 4
    assert flow["retransmitted_bytes"] == 3000
    assert flow["lost"] == 3
    assert flow["reordered"] == 0 and flow["duplicated"] == 0


def test_a_cut_received_file_counts_losses_only_as_far_as_it_goes(tmp_path: Path):
    sent = [udp(i) for i in range(50)]
    received = [udp(i) for i in range(30) if i != 12]  # cut after 29
    result = analyse_link(read_frames(write(tmp_path / "s.pcap", sent)),
                          read_frames(write(tmp_path / "r.pcap", received)),
                          received_cut=T0 + 0.03)
    assert result["totals"]["lost"] == 1 and result["complete"] is False


def test_bounded_writing_stops_at_the_limit_and_says_so(tmp_path: Path):
    path = tmp_path / "small.pcap"
    pcap = BoundedPcap(path, snap=128, max_bytes=1000)
    frame = bytes(udp(1))
    written = [pcap.write(1_700_000_000, k * 1000, len(frame), frame) for k in range(20)]
    pcap.skipped(5)
    stats = pcap.close()
    assert written[:6] == [True] * 6 and not any(written[6:])  # 24 + 6 x (16 + 128) <= 1000
    assert stats.truncated and stats.packets == 6 and stats.seen == 25
    assert stats.cut == pytest.approx(1_700_000_000 + 6e-6)
    assert path.stat().st_size == stats.bytes <= 1000
    with PcapReader(str(path)) as reader:  # scapy reads it: nanosecond timestamps, cut frames
        frames = list(reader)
    assert len(frames) == 6 and all(len(bytes(f)) == 128 for f in frames)
    assert frames[1][IP].src == A and float(frames[1].time) == pytest.approx(
        1_700_000_000 + 1e-6)
    assert pcap.close() is stats  # idempotent


class FakeRing:
    """Frames handed over as a ring would, from a list, woken through a pipe."""

    retire_ms = 5

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self.pending: list[tuple[int, int, int, bytes]] = []
        self.lock = threading.Lock()
        self.closed = False

    def push(self, count: int) -> None:
        frame = bytes(udp(0))
        with self.lock:
            self.pending += [(1_700_000_000, k, len(frame), frame) for k in range(count)]
        os.write(self._write, b"x")

    def fileno(self) -> int:
        return self._read

    def frames(self):
        with self.lock:
            ready, self.pending = self.pending, []
        with __import__("contextlib").suppress(BlockingIOError):
            os.set_blocking(self._read, False)
            os.read(self._read, 1024)
        yield from ready

    def skip(self) -> int:
        with self.lock:
            count, self.pending = len(self.pending), []
        return count

    def statistics(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        if not self.closed:
            os.close(self._read)
            os.close(self._write)
            self.closed = True


def test_a_tap_ends_its_thread_and_closes_its_file_when_stopped(tmp_path: Path):
    ring = FakeRing()
    tap = Tap(ring, tmp_path / "t.pcap", snap=128, max_bytes=10_000)
    tap.start()
    ring.push(10)
    wait_for("the tap to write the first 10 packets", lambda: tap.pcap.stats.packets,
             lambda packets: packets >= 10, 10, every=0.01)
    ring.push(100)  # more than the file takes: counted, not written
    stats = tap.stop()
    assert not tap.alive and ring.closed and tap.pcap.closed
    assert stats.truncated and stats.seen == 110 and stats.packets < 110
    assert (tmp_path / "t.pcap").stat().st_size == stats.bytes <= 10_000
    assert len(read_frames(tmp_path / "t.pcap")) == stats.packets
    assert tap.stop().packets == stats.packets  # idempotent


def test_a_capture_closes_everything_on_any_way_out(tmp_path: Path):
    """An exception (as Ctrl-C is, in the runner) inside the capture's block: every thread
    ends, every file and ring is closed and the manifest says what each file holds; a tap that
    cannot be opened closes those opened before it."""
    rings: list[FakeRing] = []

    def ring(endpoint, src, dst, snap):
        rings.append(FakeRing())
        return rings[-1]

    capture = LinkCapture(tmp_path / "capture", ring=ring)
    for src, dst in ((0, 1), (1, 0)):
        capture.add(f"{src}->{dst}", A, B, Endpoint(f"ns{src}", "eth0"),
                    Endpoint(f"ns{dst}", "eth0"))
    with pytest.raises(KeyboardInterrupt), capture:
        capture.start()
        rings[0].push(3)
        raise KeyboardInterrupt
    assert capture.alive() == [] and all(r.closed for r in rings) and len(rings) == 4
    manifest = json.loads((tmp_path / "capture" / "capture.json").read_text())
    assert [link["link"] for link in manifest["links"]] == ["0->1", "1->0"]
    assert manifest["links"][0]["sent"]["packets"] == 3
    assert manifest["links"][0]["sent"]["netns"] == "ns0"
    assert manifest["links"][0]["received"]["netns"] == "ns1"
    flows = analyse(tmp_path / "capture")
    assert flows["links"][0]["totals"]["lost"] == 3  # sent; never received (a fake ring)

    opened: list[FakeRing] = []

    def failing(endpoint, src, dst, snap):
        if len(opened) == 3:
            raise PermissionError("no CAP_NET_RAW")
        opened.append(FakeRing())
        return opened[-1]

    broken = LinkCapture(tmp_path / "broken", ring=failing)
    broken.add("0->1", A, B, Endpoint("a", "eth0"), Endpoint("b", "eth0"))
    broken.add("1->0", B, A, Endpoint("b", "eth0"), Endpoint("a", "eth0"))
    with pytest.raises(PermissionError):
        broken.start()
    assert all(r.closed for r in opened) and broken.alive() == []


def test_the_kernel_filter_keeps_one_links_frames_cut_to_snap():
    code = link_filter(A, B, 96)
    program = [struct.unpack("<HBBI", code[k:k + 8]) for k in range(0, len(code), 8)]
    assert program[1] == (0x15, 0, 5, 0x0800)
    assert program[3][3] == 0xC6120001 and program[5][3] == 0xC6120002
    assert program[-2] == (0x06, 0, 0, 96) and program[-1] == (0x06, 0, 0, 0)
    for k, (op, jt, jf, _) in enumerate(program):  # every jump lands inside the program
        if op == 0x15:
            assert k + 1 + max(jt, jf) < len(program)


def test_sizes_parse_with_units():
    assert parse_size("20MB") == 20_000_000 and parse_size("1MiB") == 2**20
    assert parse_size("512kB") == 512_000 and parse_size(4096) == 4096
    assert format_size(20_000_000) == "20MB" and format_size(2**20) == "1MiB"
    with pytest.raises(ValueError, match="a size such as"):
        parse_size("lots")


def test_the_capture_command_summarises_a_run_and_names_bad_input(tmp_path: Path):
    from typer.testing import CliRunner

    from testbed.cli import app

    capture = tmp_path / "run" / "capture"
    capture.mkdir(parents=True)
    write(capture / "0-1.sent.pcap", [udp(i) for i in range(10)])
    write(capture / "0-1.received.pcap", [udp(i) for i in range(10) if i != 4])
    entry = {"file": "", "packets": 0, "truncated": False, "kernel_drops": 0}
    (capture / "capture.json").write_text(json.dumps({"snap": 65535, "max_bytes": 10**6,
        "links": [{"link": "0->1", "src": A, "dst": B,
                   "sent": {**entry, "file": "0-1.sent.pcap"},
                   "received": {**entry, "file": "0-1.received.pcap"}}]}))
    runner = CliRunner()
    shown = runner.invoke(app, ["capture", str(tmp_path / "run")])
    assert shown.exit_code == 0, shown.output
    assert "udp 4000>5000" in shown.output and "0->1" in shown.output
    as_json = runner.invoke(app, ["capture", str(capture), "--json", "--link", "0->1"])
    assert json.loads(as_json.output)["links"][0]["totals"]["lost"] == 1
    written = runner.invoke(app, ["capture", str(tmp_path / "run"), "--write"])
    assert written.exit_code == 0 and (capture / "flows.json").exists()

    missing = runner.invoke(app, ["capture", str(tmp_path)])
    assert missing.exit_code == 2 and "RUN_DIR" in missing.output
    unknown = runner.invoke(app, ["capture", str(tmp_path / "run"), "--link", "1->0"])
    assert unknown.exit_code == 2
    assert "--link: 1->0 not captured; captured: 0->1" in unknown.output
    (capture / "0-1.received.pcap").write_bytes(b"not a pcap at all, no")
    broken = runner.invoke(app, ["capture", str(tmp_path / "run")])
    assert broken.exit_code == 1 and "0-1.received.pcap" in broken.output


def test_run_refuses_a_bad_capture_option_naming_it(tmp_path: Path):
    from typer.testing import CliRunner

    from testbed.cli import app

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 2\n")
    result = CliRunner().invoke(app, ["run", str(path), "--sandbox", "none", "--capture", "0->5"])
    assert result.exit_code == 2
    assert "--capture 0->5 (to): no worker 5: workers are 0..1" in result.output
