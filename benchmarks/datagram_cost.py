"""Datagram cost: CPU time per datagram on the datagram path, and what a flood costs the workers.

1. On loopback, the calling thread's CPU time (`time.thread_time`: user and system, the
   kernel's loopback delivery included) per datagram of MTU 1500, three paths side by side in
   every round: no source check (the receive path before it, kept here only: the endpoint's
   source table swapped for one that takes any source), the source check, and the source check
   with the run's key (a BLAKE2b MAC on every datagram). Rows: receiving (datagrams queued in
   the socket while nobody read, then one `collect` landing them in a tensor), sending unpaced
   and paced at 100 Mbit/s (one `send_tensor`), and refusing what a stranger sends (random
   bytes and well-formed forgeries from an unregistered address; forgeries from a peer's own
   address, which only the MAC refuses), each queued, then read by `poll`.
2. A flood: four lossy workers (threads of this process, loopback) all-reduce 200,000 floats
   while a flooder process (`testbed.transport.flood`, no captures: random bytes and forgeries
   naming a real rank) sends to their ports at a given rate; the slowest rank's time per call
   against the flood's rate. Without the key it sends from its own address; with the key it
   forges a peer's source address and port (a raw socket: root), so every forgery passes the
   source check and costs a MAC: the most a flood can cost.

    .venv/bin/python -m benchmarks.datagram_cost [--rounds 9] [--passes 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.report import Run
from testbed.collectives.lab import run_concurrently
from testbed.collectives.lossy import Lossy
from testbed.transport import DatagramEndpoint, Kind, flood
from testbed.transport.flood import Flood, Flooder
from testbed.transport.sources import SourceTable
from testbed.transport.tcp import Listener
from testbed.transport.udp.sockets import SO_RCVBUFFORCE

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "datagram-cost.md"
RUN = 0xD474
LOOPBACK = ("127.0.0.1", 0)
KEY = os.urandom(32)  # this benchmark's own; nothing else ever uses it
RECEIVED = 8000  # datagrams per receive and send measurement
PACED = 2000  # datagrams per paced send (0.24 s at 100 Mbit/s)
REFUSED = 4000  # datagrams per refusal measurement
RCVBUF = 64 << 20  # holds every queued datagram (the kernel doubles it)
PATHS = ("no source check", "source check", "source check + MAC")
WORLD, NUMEL, CALLS = 4, 200_000, 10
FLOOD_RATES = (0, 5_000, 20_000, 50_000)  # datagrams per second, to the four workers together
WAIT = 30.0


class _AnySource:
    """The receive path before the source check: any source is taken for any sender."""

    def __init__(self, table: SourceTable) -> None:
        self._table = table

    def registered(self, senders: np.ndarray, names: np.ndarray) -> np.ndarray:
        return np.ones(len(senders), dtype=bool)

    def owners(self, names: np.ndarray) -> np.ndarray:
        return self._table.owners(names)


def _endpoints(path: str) -> tuple[DatagramEndpoint, DatagramEndpoint]:
    """(sender rank 0, receiver rank 1) on loopback for one path."""
    key = KEY if path.endswith("MAC") else None
    receiver = DatagramEndpoint(1, RUN, LOOPBACK, rcvbuf=RCVBUF, key=key)
    sender = DatagramEndpoint(0, RUN, LOOPBACK, sndbuf=RCVBUF, key=key,
                              peers={1: receiver.address})
    receiver.add_peer(0, sender.address)
    if path == "no source check":
        receiver._sources = _AnySource(receiver._sources)
    return sender, receiver


def _sink() -> socket.socket:
    """A socket that holds what is sent to it (nobody reads it), so every send is delivered."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
    sink.bind(LOOPBACK)
    return sink


def _cpu(call: Callable[[], object]) -> float:
    started = time.thread_time()
    call()
    return time.thread_time() - started


def receive(path: str, step: int) -> float:
    sender, receiver = _endpoints(path)
    with sender, receiver:
        tensor = torch.randn(RECEIVED * receiver.chunk_numel())
        sender.send_tensor(1, Kind.GRADIENT, step, 0, tensor)
        out = torch.empty_like(tensor)
        got = None

        def collect() -> None:
            nonlocal got
            got = receiver.collect(Kind.GRADIENT, step, 0, {0: RECEIVED},
                                   time.monotonic() + WAIT, into={0: out})

        seconds = _cpu(collect)
        assert got is not None and not got.missing and torch.equal(out, tensor), path
        assert receiver.socket_counters().rcvbuf_drops == 0, "the receive buffer overflowed"
    return seconds / RECEIVED


def send(path: str, step: int, rate: float | None) -> float:
    count = PACED if rate else RECEIVED
    key = KEY if path.endswith("MAC") else None
    with _sink() as sink, DatagramEndpoint(0, RUN, LOOPBACK, rate=rate, sndbuf=RCVBUF, key=key,
                                           peers={1: sink.getsockname()}) as sender:
        tensor = torch.randn(count * sender.chunk_numel())
        seconds = _cpu(lambda: sender.send_tensor(1, Kind.GRADIENT, step, 0, tensor))
        assert sender.counters()[1].datagrams_sent == count
    return seconds / count


def refuse(path: str, from_peer: bool, per_read: int | None = None) -> float | None:
    """CPU per datagram to refuse REFUSED datagrams from a stranger (half random bytes, half
    forgeries naming rank 0 from an unregistered address) or forgeries from rank 0's own
    address: all queued, then read; or, with `per_read`, that many queued and read at a time
    (a flood read as it comes pays each read's fixed cost for a few datagrams). None where the
    path takes the forgeries (without the source check any; without the MAC those from a
    peer's address: nothing tells them apart)."""
    if path == "no source check" or (from_peer and not path.endswith("MAC")):
        return None
    sender, receiver = _endpoints(path)
    with sender, receiver, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(LOOPBACK)
        if from_peer:
            receiver.add_peer(0, stranger.getsockname())
        flooder = Flooder(Flood(targets=[sender.address, receiver.address], run_id=RUN,
                                rate=1.0, seconds=0.0, seed=PATHS.index(path)))
        kinds = ["forged"] if from_peer else ["random", "forged"]
        datagrams = [flooder.datagram(kinds[i % len(kinds)], to=1)[0] for i in range(REFUSED)]
        seconds, batch = 0.0, per_read or REFUSED
        for start in range(0, REFUSED, batch):
            for datagram in datagrams[start:start + batch]:
                stranger.sendto(datagram, receiver.address)
            seconds += _cpu(lambda end=start + batch: _read_until(receiver, end))
        assert all(c.datagrams_received == 0 for c in receiver.counters().values()), "taken"
    return seconds / REFUSED


def _read_until(receiver: DatagramEndpoint, refused: int) -> None:
    """Read until `refused` datagrams were refused in all (loopback has them queued)."""
    deadline = time.monotonic() + WAIT
    while sum(receiver.socket_counters().rejected.values()) < refused:
        assert time.monotonic() < deadline, "the refused datagrams were not all read"
        receiver.poll()


ROWS = {
    "receive, landing in a tensor": lambda path, step: receive(path, step),
    "send, unpaced": lambda path, step: send(path, step, None),
    "send, paced at 100 Mbit/s": lambda path, step: send(path, step, 100e6),
    "refuse a stranger's datagram (random bytes, forgeries)":
        lambda path, step: refuse(path, False),
    "refuse the same, 4 per read": lambda path, step: refuse(path, False, per_read=4),
    "refuse a forgery from a peer's own address": lambda path, step: refuse(path, True),
}
SENDS = ("send, unpaced", "send, paced at 100 Mbit/s")  # the source check is not on this path


def costs(rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per row and path, the cost per datagram of each round (paths side by side per round)."""
    figures: dict[str, dict[str, list[float]]] = {row: {p: [] for p in PATHS} for row in ROWS}
    step = 0
    for _ in range(rounds):
        for row, measure in ROWS.items():
            for path in PATHS:
                if row in SENDS and path == "no source check":
                    continue
                step += 1
                value = measure(path, step)
                if value is not None:
                    figures[row][path].append(value)
        print(f"round {len(figures['send, unpaced']['source check'])} of {rounds}",
              file=sys.stderr, flush=True)
    return figures


# -- the flood ------------------------------------------------------------------------------


def workers(keyed: bool) -> list[Lossy]:
    key = KEY if keyed else None
    endpoints = [DatagramEndpoint(rank, RUN, LOOPBACK, rcvbuf=8 << 20, key=key)
                 for rank in range(WORLD)]
    listeners = [Listener(LOOPBACK, key=key) for _ in range(WORLD)]
    return run_concurrently(*(
        lambda rank=rank: Lossy(rank, WORLD, addresses=[e.address for e in endpoints],
                                endpoint=endpoints[rank], listener=listeners[rank], run_id=RUN,
                                stream_addresses=[x.address for x in listeners],
                                deadline_initial=5.0, deadline_floor=5.0, settle=None)
        for rank in range(WORLD)))


def refused(worker: Lossy) -> int:
    return sum(worker.endpoint.socket_counters().rejected.values())


@dataclass
class FloodRow:
    """One flood rate's figures over every pass. A `decoy` row floods sockets nobody reads
    instead of the workers: the flooder's own cost to the machine, without the workers'."""

    rate: int
    decoy: bool = False
    seconds: list[float] = field(default_factory=list)  # the slowest rank's, per call
    exact: int = 0  # calls whose every result was the exact mean
    sent: int = 0
    flooding: float = 0.0  # seconds the flooder ran
    flooder_cpu: float = 0.0  # of which its own CPU seconds
    refused: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def flood_cell(group: list[Lossy], keyed: bool, row: FloodRow, step: int) -> None:
    """CALLS all-reduces under a flood of `row.rate` datagrams/s, into `row`."""
    before = sum(map(refused, group))
    flooder = None
    with contextlib.ExitStack() as stack:
        if row.rate:
            targets = [w.endpoint.address for w in group]
            if row.decoy:
                targets = [stack.enter_context(_sink()).getsockname() for _ in group]
            spec = Flood(targets=targets, run_id=RUN, rate=row.rate, seconds=120.0,
                         seed=row.rate + step, spoof=keyed)
            flooder = flood.start(spec, timeout=WAIT)
            stack.callback(_end, flooder)  # if a call fails: no flooder left behind
        _calls(group, row, step)
        report = None if flooder is None else flood.stop(flooder, WAIT)
    if report is None:
        return
    sent = sum(sum(kinds.values()) for kinds in report["sent"].values())
    deadline = time.monotonic() + WAIT  # the rest of the flood, before the next cell
    while not row.decoy and sum(map(refused, group)) - before < sent:
        assert time.monotonic() < deadline, "the flood's datagrams were not all refused"
        for worker in group:
            worker.endpoint.poll(0.01)
    row.sent += sent
    row.flooding += report["seconds"]
    row.flooder_cpu += report["cpu_seconds"]
    row.refused += sum(map(refused, group)) - before


def _end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _calls(group: list[Lossy], row: FloodRow, step: int) -> None:
    """CALLS all-reduces: the slowest rank's seconds and whether each was exact, into `row`."""
    for call in range(CALLS):
        inputs = [(r + 1 + call + torch.arange(NUMEL) % 7).float() for r in range(WORLD)]
        expected = torch.stack(inputs).double().mean(0).float()
        results = run_concurrently(*(lambda r=r, x=inputs[r], s=step + call:
                                     group[r].allreduce(x, s) for r in range(WORLD)),
                                   wait=120.0)
        row.seconds.append(max(stats.seconds for _, stats in results))
        row.exact += all(torch.equal(result, expected) for result, _ in results)


def floods(passes: int) -> dict[bool, list[FloodRow]]:
    """Per mode (keyed or not), the rates in turn, `passes` times over: a machine whose load
    drifts meets every rate alike."""
    found: dict[bool, list[FloodRow]] = {}
    for keyed in (False, True):
        if keyed and os.geteuid() != 0:
            print("not root: no flood with forged source addresses", file=sys.stderr)
            continue
        group = workers(keyed)
        rows = [FloodRow(rate) for rate in FLOOD_RATES]
        if not keyed:  # the flooder's own cost, once
            rows += [FloodRow(rate, decoy=True) for rate in FLOOD_RATES if rate]
        try:
            for turn in range(passes):
                for i, row in enumerate(rows):
                    flood_cell(group, keyed, row, CALLS * (turn * len(rows) + i))
        finally:
            for worker in group:
                worker.close()
        found[keyed] = rows
        print(f"flood {'keyed' if keyed else 'open'} done", file=sys.stderr, flush=True)
    return found


# -- the report -----------------------------------------------------------------------------


def us(values: list[float]) -> str:
    if not values:
        return "-"
    low, middle, high = min(values), statistics.median(values), max(values)
    return f"{middle * 1e6:.1f} us ({low * 1e6:.1f}-{high * 1e6:.1f})"


def ratio(paths: dict[str, list[float]], path: str, over: str) -> str:
    return f"{statistics.median(paths[path]) / statistics.median(paths[over]):.2f}x"


def report(figures: dict[str, dict[str, list[float]]], flooded: dict[bool, list[FloodRow]],
           run: Run, rounds: int, passes: int) -> str:
    rows = []
    for row, paths in figures.items():
        cells = []
        for path in PATHS:
            if row in SENDS and path == "no source check":
                cells.append("(nothing to check)")
            elif row.startswith("refuse") and not paths[path]:
                cells.append("forgeries taken")
            else:
                cells.append(us(paths[path]))
        rows.append(f"| {row} | " + " | ".join(cells) + " |")
    receive = figures["receive, landing in a tensor"]
    ratios = [f"the source check {ratio(receive, 'source check', 'no source check')} the "
              "receive cost without it",
              f"the MAC {ratio(receive, 'source check + MAC', 'source check')} the receive "
              "cost without it"]
    ratios += [f"{ratio(figures[row], 'source check + MAC', 'source check')} for "
               f"{row.split(', ', 1)[1]} sends" for row in SENDS]
    flood_lines = []
    for keyed, by_rate in flooded.items():
        base = by_rate[0].median
        mode = ("with the key, every datagram from a forged peer address" if keyed
                else "without the key, from the flooder's own address")
        flood_lines += [f"#### {mode}", "",
                        "| flood (datagrams/s, asked / sent) | time per call, median (worst) "
                        "| over no flood | exact calls | refused | the flooder's own CPU "
                        "(cores) |",
                        "| --- | --- | --- | --- | --- | --- |"]
        for row in by_rate:
            achieved = row.sent / row.flooding if row.flooding else 0.0
            cores = row.flooder_cpu / row.flooding if row.flooding else 0.0
            rate = f"{row.rate:,} / {achieved:,.0f}" + (" to a decoy" if row.decoy else "")
            flood_lines.append(
                f"| {rate} | {row.median * 1e3:.0f} ms "
                f"({max(row.seconds) * 1e3:.0f} ms) | {row.median / base:.2f}x | "
                f"{row.exact} of {len(row.seconds)} | {row.refused:,} | {cores:.2f} |")
        flood_lines.append("")
    return "\n".join([
        *run.header("Datagram cost: per datagram, with and without the source check and the "
                    "MAC; and under a flood"),
        "### CPU time per datagram (loopback, MTU 1500)",
        "",
        f"The calling thread's CPU time (`time.thread_time`, user and system: the kernel's "
        f"loopback delivery is in it) per datagram, median of {rounds} rounds (range), the "
        "three paths side by side in every round. Payload 1428 bytes per datagram (1412 with "
        f"the MAC's 16). Receive: {RECEIVED} datagrams queued while nobody read, then one "
        f"`collect` landing them in a tensor. Send: one `send_tensor` of {RECEIVED} datagrams "
        f"(paced: {PACED}) into a socket that holds them. Refuse: {REFUSED} datagrams queued, "
        "then read by `poll` until all were refused (or 4 at a time: queued, then read, as a "
        "flood is read when it comes in a trickle): half random bytes, half well-formed "
        "forgeries naming rank 0 from an unregistered address (refused by the header checks "
        "and the source check); or forgeries from rank 0's own address (only the MAC tells "
        "them apart). *no source check* is the receive path before the check, kept in this "
        "benchmark only.",
        "",
        "| | " + " | ".join(PATHS) + " |",
        "| --- " * (len(PATHS) + 1) + "|",
        *rows,
        "",
        "Ratios of medians: " + "; ".join(ratios) + ".",
        "",
        "### Under a flood",
        "",
        f"Four lossy workers (threads of one process, loopback, a fixed 5 s deadline and no "
        "`settle`: a phase waits for every chunk, so a result that is not exact is the "
        "flood's doing, not a reordered tail taken for the end of a stream) all-reduce "
        f"{NUMEL:,} floats, {passes} passes over the rates in turn, {CALLS} calls per rate and "
        "pass, while a flooder process "
        "(`testbed.transport.flood`, without captures: random bytes and forgeries naming a "
        "real rank, in turn) sends to their ports; in each pass and rate the flood starts "
        "before the first call and ends after the last. Time per call is the slowest rank's. "
        "The flooder's rate is a bound (a flooder that falls behind skips, it does not catch "
        "up); *sent* is what it "
        "managed on this machine. *refused* counts the four workers' refusals over the whole "
        "row, the flood during and after the calls. Every call's result is compared with "
        "the exact mean (the inputs are small integers). The flooder runs on the same two "
        "cores as the workers: its own CPU (process time over its run) is part of what slows "
        "them: rows *to a decoy* send the same flood to sockets nobody reads, so the workers "
        "pay nothing but share the machine with the flooder. What the flood costs the "
        "workers' receive path itself is the refusal rows "
        "above times the rate.",
        "",
        *flood_lines,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.datagram_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = Run.start("benchmarks.datagram_cost")
    figures = costs(args.rounds)
    flooded = floods(args.passes)
    text = report(figures, flooded, run, args.rounds, args.passes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
