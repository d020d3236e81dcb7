"""The parent's side of a cell: each rank's options, the lab's shaping, and one process per
rank driven through its calls within their timeouts, whatever happens."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.collectives.cells import LOSSY_PACE_CAP, PACE, WORLD, Cell, Outcome
from benchmarks.collectives.inputs import offsets, spread
from netem.profile import DEFAULT_LIMIT
from testbed.transport.auth import write_key

REPO = Path(__file__).resolve().parents[2]
MTU = 1500
FRAME_PAYLOAD = 1428 / 1514  # lossy: float bytes per Ethernet frame byte at MTU 1500
STARTUP = 120.0  # seconds for four processes to import torch, build inputs and meet


def options_for(cell: Cell, lab, port: int, key_file: Path) -> list[dict[str, Any]]:
    """Each rank's constructor options: ports from `port` upwards, fresh for every cell;
    `lossy-keyed`'s key in `key_file`."""
    hosts = lab.hosts
    timeout = cell.call_timeout
    if cell.kind.startswith("gloo"):
        master = (hosts[0].address, port)
        return [{"master": master, "timeout": timeout + 60} for _ in hosts]
    if cell.kind == "ring":
        addresses = [(h.address, port) for h in hosts]
        return [{"addresses": addresses, "timeout": timeout, "congestion": cell.congestion,
                 "run_id": port} for _ in hosts]
    if cell.kind == "moshpit":
        store = (hosts[0].address, port)
        return [{"store": store, "listen": (h.address, port + 1), "timeout": timeout,
                 "expiry": 15.0, "congestion": cell.congestion, "run_id": port,
                 "rendezvous_timeout": STARTUP * max(1, cell.world // WORLD)} for h in hosts]
    if cell.kind.startswith("lossy"):
        pace = min(LOSSY_PACE_CAP, PACE * (cell.rate or math.inf))
        # One phase: each worker sends 3/4 of the tensor, paced, in MTU-sized datagrams.
        phase = (cell.world - 1) / cell.world * cell.bytes / FRAME_PAYLOAD * 8 / pace
        ceiling = timeout / 2.5
        initial = min(1.5 * phase + 2.0, ceiling)  # the warm-up's, until one is learned
        addresses = [(h.address, port) for h in hosts]
        keyed = {"key_file": str(key_file)} if cell.kind == "lossy-keyed" else {}
        return [{"addresses": addresses, "rate": pace, "mtu": MTU, "run_id": port,
                 "deadline_initial": initial, "deadline_ceiling": ceiling,
                 "rcvbuf": 16 << 20, **keyed} for _ in hosts]
    raise ValueError(cell.kind)


def shape(lab, rate: float | None, loss: float, uplinks: bool = False,
          limit: int = DEFAULT_LIMIT, idle_restart: bool = True) -> None:
    """Every downlink (and with `uplinks` every uplink) at `rate` with `loss`, its queue
    `limit` packets; without `idle_restart`, net.ipv4.tcp_slow_start_after_idle=0 on every
    host (a new namespace starts with the kernel's default, 1)."""
    from netem import apply
    from netem.profile import LinkProfile

    if not idle_restart:
        for host in lab.hosts:
            written = lab.run(host, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"])
            if written.returncode:
                raise OSError(f"{host.netns}: sysctl: {written.stderr.strip()}")
    if rate is None and not loss:
        return
    spec: dict[str, Any] = {"limit": limit}
    if rate is not None:
        spec["rate"] = f"{int(rate)}bit"
    if loss:
        spec["loss"] = loss
    profile = LinkProfile.parse(spec)
    for host in lab.hosts:  # every host's downlink: the switch port towards it
        apply(host.switch_port, profile, netns=lab.switch, backend="fallback")
        if uplinks and rate is not None:  # and its uplink: its own port's egress
            apply(host.iface, LinkProfile.parse({"rate": spec["rate"], "limit": limit}),
                  netns=host.netns, backend="fallback")


def run_cell(lab, cell: Cell, port: int, logs: Path) -> Outcome:
    """Start one process per rank, run the warm-up and the timed calls, each call within its
    timeout; kill whatever is left, whatever happens."""
    started = time.monotonic()
    outcome = Outcome(cell, "failed")
    from testbed.cluster.network import set_default_congestion

    # gloo's sockets are not ours to set: every namespace's default is the cell's algorithm
    algorithm = cell.kind.split("-", 1)[1] if cell.kind.startswith("gloo") else cell.congestion
    set_default_congestion({host.netns: algorithm for host in lab.hosts})
    calls = cell.warmups + cell.reps
    lines: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
    processes: list[subprocess.Popen[str]] = []
    errors = []
    try:
        key_file = logs / "run.key"
        if not key_file.exists():
            write_key(key_file)
        for rank, options in enumerate(options_for(cell, lab, port, key_file)):
            spec = {"rank": rank, "kind": cell.kind.split("-")[0], "numel": cell.numel,
                    "world": cell.world, "calls": calls, "options": options,
                    "warmup_numel": cell.warmup_numel, "warmups": cell.warmups,
                    "setup_call": cell.setup_call}
            error = (logs / f"{cell.kind}-{cell.numel}-{rank}.err").open("w")
            errors.append(error)
            process = lab.popen(lab.hosts[rank], [sys.executable, "-m",
                                                  "benchmarks.collectives.worker",
                                                  json.dumps(spec)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=error,
                                cwd=REPO, start_new_session=True,
                                # gloo binds where the host name resolves (loopback) otherwise
                                env={**os.environ, "GLOO_SOCKET_IFNAME": lab.hosts[rank].iface})
            processes.append(process)
            transcript = logs / f"{cell.kind}-{cell.numel}-{rank}.out"
            threading.Thread(target=_read, args=(rank, process, lines, transcript),
                             daemon=True).start()

        world = cell.world
        inbox: dict[int, list[dict[str, Any]]] = {rank: [] for rank in range(world)}
        ended: set[int] = set()

        def gather(event: str, timeout: float) -> dict[int, dict[str, Any]] | None:
            """The next `event` line from every rank (lines are kept in order per rank, so one
            that came early waits its turn); None if the time ran out."""
            got: dict[int, dict[str, Any]] = {}
            deadline = time.monotonic() + timeout
            while True:
                for rank in range(world):
                    while rank not in got and inbox[rank]:
                        line = inbox[rank].pop(0)
                        if line.get("event") == event:
                            got[rank] = line
                    if rank not in got and rank in ended:
                        raise WorkerDied(rank)
                if len(got) == world:
                    return got
                remaining = deadline - time.monotonic()
                try:  # short waits: a signal to this process is handled within a second
                    rank, line = lines.get(timeout=min(0.5, max(0.0, remaining)))
                except queue.Empty:
                    if remaining <= 0:
                        return None
                    continue
                if line is None:  # its stdout closed
                    ended.add(rank)
                else:
                    inbox[rank].append(line)

        startup = STARTUP * max(1, world // WORLD)  # processes import torch on two cores
        if gather("ready", startup) is None:
            outcome.status, outcome.note = "timeout", f"not ready within {startup:.0f} s"
            return outcome
        per_call = []
        for call in range(calls):
            if call == cell.warmups:
                cpu_before = cpu_times()
            for process in processes:
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
            got = gather("call", cell.call_timeout)
            if got is None:
                outcome.status = "timeout"
                outcome.note = (f"warm-up {call + 1}" if call < cell.warmups
                                else f"timed call {call - cell.warmups + 1}") + " timed out"
                return outcome
            per_call.append(got)
        outcome.cpu_busy = cpu_busy(cpu_before, cpu_times())
        done = gather("done", 60.0)
        if done is None:
            outcome.note = "no final report within 60 s"
            return outcome
        outcome.warmup = max(line["seconds"] for line in per_call[cell.warmups - 1].values())
        timed = per_call[cell.warmups:]
        outcome.seconds = [max(line["seconds"] for line in got.values()) for got in timed]
        outcome.coverage = sum(line["coverage"] for got in timed for line in got.values()) / (
            world * len(timed))
        counters: dict[str, float] = {}
        for got in timed:
            for line in got.values():
                for key, value in line["extra"].items():
                    if key.endswith("_seconds"):
                        counters[key] = max(counters.get(key, 0.0), value)
                    else:
                        counters[key] = counters.get(key, 0.0) + value
        outcome.counters = counters
        starts = [[line["started"] for line in got.values()] for got in timed]
        ends = [[line["started"] + line["seconds"] for line in got.values()] for got in timed]
        # CLOCK_MONOTONIC: one clock for every namespace
        outcome.start_skew = sum(max(s) - min(s) for s in starts) / len(timed)
        outcome.after_last_start = sum(max(e) - max(s) for s, e in zip(starts, ends,
                                                                       strict=True)) / len(timed)
        if all(line.get("rounds") for got in timed for line in got.values()):
            outcome.round_seconds = [  # the slowest peer's round, its phases with it
                tuple(sum(column) / len(timed) for column in zip(*(
                    max((line["rounds"][i] for line in got.values()), key=lambda r: r[0])
                    for got in timed), strict=True))
                for i in range(len(timed[0][0]["rounds"]))]
            outcome.outside_rounds = sum(
                max(line["seconds"] - sum(r[0] for r in line["rounds"])
                    for line in got.values()) for got in timed) / len(timed)
        outcome.exact = all(line["exact"] for line in done.values())
        # the worker reports |result - mean| / |own input - mean|; own input - mean is
        # offsets[rank] * noise, so this is the error over the inputs' rms distance to the mean
        outcome.relative_error = max(
            line["relative_error"] * abs(offsets(world)[rank]) / spread(world)
            for rank, line in done.items())
        outcome.extra_memory = max(line["extra_memory"] for line in done.values())
        outcome.call_memory = max(line["call_memory"] for line in done.values())
        outcome.tcp = done[0]["tcp"]
        outcome.tcp_default = done[0]["tcp_default"]
        outcome.status = "ok"
        if cell.loss == 0 and not outcome.exact:
            outcome.note = ("not the true mean on a lossless link" + (
                f": coverage {outcome.coverage:.4f} (chunks late or dropped by the host)"
                if outcome.coverage < 1 else ": WRONG RESULT"))
        return outcome
    except WorkerDied as died:
        log = logs / f"{cell.kind}-{cell.numel}-{died.rank}.err"
        with contextlib.suppress(subprocess.TimeoutExpired):
            processes[died.rank].wait(timeout=5)
        outcome.note = (f"rank {died.rank} exited ({processes[died.rank].returncode}): "
                        f"{_tail(log)}")
        return outcome
    finally:
        for process in processes:
            _kill(process, wait=10.0 if outcome.status == "ok" else 0.0)
        for error in errors:
            error.close()
        outcome.wall = time.monotonic() - started


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all the host's CPUs, from /proc/stat (idle and iowait idle)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def cpu_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the host's CPU time that was not idle between two `cpu_times`."""
    total = after[1] - before[1]
    return 1 - (after[0] - before[0]) / total if total else math.nan


class WorkerDied(Exception):
    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.rank = rank


def _read(rank: int, process: subprocess.Popen[str], lines: queue.Queue,
          transcript: Path) -> None:
    assert process.stdout is not None
    with transcript.open("w") as copy:
        for text in process.stdout:
            copy.write(text)
            copy.flush()
            _parse(rank, text.strip(), lines)
    lines.put((rank, None))


def _parse(rank: int, text: str, lines: queue.Queue) -> None:
    if text.startswith("{"):
        with contextlib.suppress(json.JSONDecodeError):
            lines.put((rank, json.loads(text)))


def _kill(process: subprocess.Popen[str], wait: float) -> None:
    """Close its stdin (a worker past its calls then exits on its own) and give it `wait`
    seconds; then kill it."""
    with contextlib.suppress(OSError):
        process.stdin.close()
    if process.poll() is None:
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text().strip().splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no log)"
