"""Capture benchmark: how fast a link's two pcap files are summarised per flow, and how many
frames a second the taps keep up with.

1. Summary: synthetic pcap files of one link (a TCP stream of full segments and a UDP flow,
   frames cut to 128 bytes as a run keeps them) with 10% of the frames lost, 1% reordered and
   a few duplicated on the way; the time `read_frames` takes for both files (scapy's
   RawPcapReader) and `analyse_link` (the numpy dissection and matching), and that the
   counts come out right.
2. Taps (root): two hosts of a lab, a TCP stream from one to the other with both directions
   captured (four taps), against the same stream without them: throughput, frames a second
   through the busiest tap, and frames the kernel had to drop because a ring was full.

Writes benchmarks/results/capture.md.

    .venv/bin/python -m benchmarks.capture [--frames 10000,50000,200000] [--stream-mb 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.report import Run
from netem.capture import BoundedPcap, LinkCapture, analyse_link, read_frames

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "capture.md"
SNAP = 128
LOSS, REORDER, DUPLICATE = 0.10, 0.01, 0.001


def _frame(protocol: int, ip_id: int, seq: int, payload: int) -> tuple[bytes, int]:
    """An Ethernet/IPv4 frame from 198.18.0.1 to .2, cut to SNAP bytes, and its length."""
    if protocol == 6:
        l4 = struct.pack(">HHIIBBHHH", 40000, 5001, seq, 1, 0x80, 0x10, 512, 0, 0) + b"\1" * 12
    else:
        l4 = struct.pack(">HHHH", 4000, 5000, 8 + payload, 0) + struct.pack(">I", seq)
    total = 20 + len(l4) + payload - (0 if protocol == 6 else 4)
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, total, ip_id, 0x4000, 64, protocol, 0,
                     socket.inet_aton("198.18.0.1"), socket.inet_aton("198.18.0.2"))
    frame = b"\2" * 12 + b"\x08\x00" + ip + l4
    length = 14 + total
    return frame.ljust(SNAP, b"t")[:min(SNAP, length)], length


def synthetic(directory: Path, frames: int, seed: int = 1) -> dict[str, int]:
    """A link's sent and received files with known losses, reorders and duplicates."""
    rng = np.random.default_rng(seed)
    sent: list[tuple[bytes, int]] = []
    seq = 1000
    for k in range(frames):
        if k % 4 == 3:  # a quarter of the frames: datagrams numbered k
            sent.append(_frame(17, 0, k, 400))
        else:
            sent.append(_frame(6, k & 0xFFFF, seq, 1448))
            seq = (seq + 1448) % 2**32
    kept = np.flatnonzero(rng.random(frames) >= LOSS)
    order = kept.copy()
    swaps = rng.choice(len(order) - 1, size=int(len(order) * REORDER), replace=False)
    for i in swaps:  # a frame overtakes its neighbour
        order[i], order[i + 1] = order[i + 1], order[i]
    copies = rng.choice(len(order), size=int(len(order) * DUPLICATE), replace=False)
    arrivals = np.insert(order, np.sort(copies), order[np.sort(copies)])
    start = 1_700_000_000
    for name, indexes, late in (("sent", range(frames), 0), ("received", arrivals, 100_000)):
        pcap = BoundedPcap(directory / f"{name}.pcap", snap=SNAP, max_bytes=2**40)
        for position, index in enumerate(indexes):
            data, length = sent[int(index)]
            nanoseconds = position * 10_000 + late
            pcap.write(start + nanoseconds // 10**9, nanoseconds % 10**9, length, data)
        pcap.close()
    return {"lost": frames - len(kept), "duplicated": len(copies)}


def summary_speed(counts: list[int]) -> list[dict[str, float]]:
    rows = []
    for frames in counts:
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(scratch)
            expected = synthetic(directory, frames)
            began = time.perf_counter()
            sent = read_frames(directory / "sent.pcap")
            received = read_frames(directory / "received.pcap")
            read = time.perf_counter() - began
            began = time.perf_counter()
            result = analyse_link(sent, received)
            analysed = time.perf_counter() - began
        totals = result["totals"]
        assert totals["lost"] == expected["lost"], (totals, expected)
        assert totals["duplicated"] == expected["duplicated"], (totals, expected)
        assert totals["retransmitted"] == 0 and totals["unmatched"] == 0, totals
        rows.append({"frames": frames, "received": len(received), "read": read,
                     "analyse": analysed, "reordered": totals["reordered"]})
        print(f"{frames} frames: read {read:.2f} s, analysed {analysed:.2f} s")
    return rows


def _stream(lab, megabytes: int) -> float:
    """Seconds a TCP stream of `megabytes` from host 0 to host 1 takes."""
    from netem.namespace import inside

    a, b = lab.hosts
    with inside(b.netns):
        server = socket.create_server((b.address, 5001))
    with inside(a.netns):
        client = socket.socket()
    client.connect((b.address, 5001))
    conn, _ = server.accept()

    def drain() -> None:
        while conn.recv(1 << 20):
            pass

    reader = threading.Thread(target=drain)
    reader.start()
    chunk = b"x" * (1 << 20)
    began = time.perf_counter()
    for _ in range(megabytes):
        client.sendall(chunk)
    client.close()
    reader.join()
    elapsed = time.perf_counter() - began
    for sock in (conn, server):
        sock.close()
    return elapsed


def tap_speed(megabytes: int) -> dict[str, float]:
    from netem.lab import Lab

    with Lab(2) as lab:
        plain = _stream(lab, megabytes)
        with tempfile.TemporaryDirectory() as scratch:
            capture = LinkCapture(scratch, snap=SNAP, max_bytes=2**40)
            capture.add_lab_link(lab, 0, 1)
            capture.add_lab_link(lab, 1, 0)
            capture.start()
            captured = _stream(lab, megabytes)
            manifest = capture.close()
    assert manifest is not None
    busiest = max((link[side] for link in manifest["links"] for side in ("sent", "received")),
                  key=lambda tap: tap["packets"])
    drops = sum(link[side]["kernel_drops"] for link in manifest["links"]
                for side in ("sent", "received"))
    figures = {"megabytes": megabytes, "plain": plain, "captured": captured,
               "frames": busiest["packets"], "drops": drops}
    print(f"stream of {megabytes} MB: {plain:.2f} s plain, {captured:.2f} s captured, "
          f"{busiest['packets']} frames, {drops} dropped")
    return figures


def write(rows: list[dict[str, float]], taps: dict[str, float] | None, run: Run) -> None:
    lines = [
        *run.header("Capture: per-flow summaries and taps"),
        "### Summarising a link's two files (`analyse_link`)",
        "",
        f"Synthetic files of one link, frames cut to {SNAP} bytes: three TCP segments of 1448 "
        f"bytes to one UDP datagram, {LOSS:.0%} of the frames lost, {REORDER:.0%} overtaking "
        f"a neighbour, {DUPLICATE:.1%} duplicated. `read` is both files through scapy's "
        "RawPcapReader into arrays, `analyse` the dissection, matching and per-flow counts "
        "(numpy); every count checked against what was made.",
        "",
        "| frames sent | frames received | read | analyse | total | per 1000 sent |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        total = row["read"] + row["analyse"]
        lines.append(f"| {row['frames']:,} | {row['received']:,} | {row['read']:.2f} s | "
                     f"{row['analyse']:.2f} s | {total:.2f} s | "
                     f"{total / row['frames'] * 1e6:.0f} ms |")
    if taps is not None:
        plain = taps["megabytes"] * 8 / taps["plain"]
        captured = taps["megabytes"] * 8 / taps["captured"]
        lines += [
            "",
            "### Taps keeping up (`LinkCapture`, root)",
            "",
            f"A TCP stream of {taps['megabytes']:.0f} MB between two hosts of a lab, unshaped, "
            "with both directions captured (four taps, each a 4 MiB ring and a thread) and "
            "without.",
            "",
            "| without | with | frames through the busiest tap | frames a second | dropped |",
            "| --- | --- | --- | --- | --- |",
            f"| {plain:.0f} Mbit/s | {captured:.0f} Mbit/s | {taps['frames']:,.0f} | "
            f"{taps['frames'] / taps['captured']:,.0f} | {taps['drops']:.0f} |",
        ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", default="10000,50000,200000",
                        help="frames sent per synthetic link, comma-separated")
    parser.add_argument("--stream-mb", type=int, default=300,
                        help="megabytes of the captured TCP stream (0: skip the taps)")
    args = parser.parse_args()
    run = Run.start("benchmarks.capture")
    rows = summary_speed([int(n) for n in args.frames.split(",")])
    taps = tap_speed(args.stream_mb) if args.stream_mb and os.geteuid() == 0 else None
    write(rows, taps, run)


if __name__ == "__main__":
    main()
