"""Collectives benchmark: all-reduce among four workers in namespaces on shaped links.

`lossy` (also `lossy-keyed`: with a run key, a MAC on every datagram), `ring`, `moshpit` and
`gloo` (twice: TCP cubic and TCP bbr) side by side, on 1M, 10M
and 100M float32 elements, with every host's downlink rate-limited (100 Mbit/s, 1 Gbit/s) and
losing 0/1/5/10% of its packets (the host kernel's fallback shaping: htb rate, nftables loss, on
the switch-side ports), plus one unshaped set compared against gloo. Every worker is its own
process in its own namespace; the parent starts them together for each call (a line on their
stdin), so no call pays for another's start. Writes benchmarks/results/collectives.md.
`--grid` runs Moshpit on a grid instead: 8 and 16 peers in groups of four, every peer's
downlink and uplink at 100 Mbit/s, against the bound of one group all-reduce per grid axis
(benchmarks/results/collectives-moshpit-grid.md).

    .venv/bin/python -m benchmarks.collectives [--quick] [--grid] [--congestion ALGO] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import machine
from testbed.collectives.grid import Grid
from testbed.scenario.model import Topology
from testbed.transport.auth import write_key

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "collectives.md"
GRID_RESULTS = REPO / "benchmarks" / "results" / "collectives-moshpit-grid.md"
WORLD = 4
GRID_WORLDS = (8, 16)  # --grid: Moshpit's peers, in groups of GRID_GROUP
GRID_KINDS = ("moshpit", "ring")  # --grid: the ring shows what TCP reaches on the same links
GRID_GROUP = 4
GRID_RATE = 100e6  # --grid: every peer's downlink and uplink
SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}
RATES = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}
LOSSES = (0.0, 0.01, 0.05, 0.10)
KINDS = ("lossy", "lossy-keyed", "ring", "moshpit", "gloo-cubic", "gloo-bbr")
# ring and moshpit, per socket: a scenario's default (cubic), not this host's (bbr here)
TCP_CONGESTION = Topology.model_fields["congestion"].default
REPS = {1_000_000: 5, 10_000_000: 2, 100_000_000: 1}  # timed calls, after the warm-ups
QUICK_REPS = {1_000_000: 3, 10_000_000: 1}
# The warm-up call sets up connections and buffers; past this size the others warm up on a
# slice of the input (lossy always warms up on the whole: it learns its deadlines from it).
WARMUP_NUMEL = 10_000_000
# Every collective but lossy first makes a call of this many elements: it sets up the
# connections and threads, so what the later calls add to memory is the tensor's alone. (Lossy
# would learn its deadlines from it.)
SETUP_NUMEL = 1024
MTU = 1500
FRAME_PAYLOAD = 1428 / 1514  # lossy: float bytes per Ethernet frame byte at MTU 1500
# Lossy's pacing, as a fraction of the link rate. Each sender interleaves its three peers, so
# a downlink gets at most its rate from the four together; the batched receivers keep up (no
# rcvbuf drops, nothing lost on lossless links at 100 Mbit/s and 1 Gbit/s). At 0.97, with one
# Python call per datagram, the receivers fell behind and the headroom was for the queue.
PACE = 1.0
# Lossy's pacing never goes past this (unshaped links have no rate to pace at). Four workers on
# two cores move about 450 Mbit/s each when paced faster; at this pace they keep up, and the
# deadlines computed from it hold. With one Python call per datagram, the receivers dropped
# datagrams beyond 200 Mbit/s.
LOSSY_PACE_CAP = 400e6
STARTUP = 120.0  # seconds for four processes to import torch, build inputs and meet
SEED = 20261122
OFFSETS = (-3.0, -1.0, 0.5, 3.5)  # input_r = mean + OFFSETS[r] * noise; no subset sums to 0
TOLERANCE = 1e-5


def offsets(world: int) -> tuple[float, ...]:
    """The inputs' offsets (input_r = mean + offsets[r] * noise): they sum to zero and no
    proper subset does. Four workers: OFFSETS. More: every offset but the last positive
    (0.1 to 0.11) and the last the negative of their sum, so a subset sums to zero only with
    the last and all the others; small, so float32 rounding stays far below TOLERANCE."""
    if world == len(OFFSETS):
        return OFFSETS
    rest = [0.1 * (1 + rank / world**2) for rank in range(world - 1)]
    return (*rest, -sum(rest))


def spread(world: int) -> float:
    """The inputs' rms offset."""
    return math.sqrt(sum(c * c for c in offsets(world)) / world)


# -- the worker process ---------------------------------------------------------------------


def make_input(rank: int, numel: int, world: int = WORLD):
    """(the true mean, this rank's input): the inputs average to the mean exactly, and no
    proper subset of them does, so a result that left a worker out cannot pass as correct.
    Built in place: no temporaries inflate the memory baseline."""
    import torch

    mean = torch.randn(numel, generator=torch.Generator().manual_seed(SEED))
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(SEED + 1))
    mine.mul_(offsets(world)[rank]).add_(mean)
    return mean, mine


def compare(result, mean, mine, block: int = 1 << 20) -> tuple[bool, float]:
    """(result equals the mean within TOLERANCE, |result - mean| / |own input - mean|), in
    blocks so the check allocates nothing the size of the tensor."""
    import torch

    exact, error, alone = True, 0.0, 0.0
    for start in range(0, mean.numel(), block):
        r, m, x = (t[start:start + block] for t in (result, mean, mine))
        exact = exact and bool(torch.allclose(r, m, rtol=TOLERANCE, atol=TOLERANCE))
        error += (r - m).double().pow(2).sum().item()
        alone += (x - m).double().pow(2).sum().item()
    return exact, math.sqrt(error / alone) if alone else 0.0


def resident_kb(reset_peak: bool = False) -> int | None:
    """This process's resident kB now; with `reset_peak`, its peak (VmHWM) starts again here."""
    if reset_peak:
        Path("/proc/self/clear_refs").write_text("5")
    return machine.status_kb("VmRSS")


def tcp_algorithms() -> dict[str, int]:
    """Congestion control of this namespace's established TCP sockets, from `ss -ti`."""
    known = ("cubic", "bbr", "reno")
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True).stdout
    counts: dict[str, int] = {}
    for token in out.split():
        if token in known:
            counts[token] = counts.get(token, 0) + 1
    return counts


def build(spec: dict[str, Any]):
    from testbed.collectives import create
    from testbed.transport.auth import read_key

    rank, kind, options = spec["rank"], spec["kind"], dict(spec["options"])
    if "key_file" in options:  # the run's key, as a placement hands it: a file, never argv
        options["key"] = read_key(Path(options.pop("key_file")))
    for key in ("addresses", "stream_addresses"):
        if key in options:
            options[key] = [tuple(address) for address in options[key]]
    for key in ("master", "store", "listen"):
        if key in options:
            options[key] = tuple(options[key])
    return create(kind, rank, spec["world"], **options)


def worker(spec: dict[str, Any]) -> None:
    """One rank: build the inputs and the collective, say ready, then one all-reduce per "go"
    line on stdin, one JSON line each; then memory, correctness and the TCP algorithms."""
    import torch

    torch.set_num_threads(1)
    rank, numel, calls = spec["rank"], spec["numel"], spec["calls"]

    def say(**fields: Any) -> None:
        print(json.dumps({"rank": rank, **fields}), flush=True)

    mean, mine = make_input(rank, numel, spec["world"])
    collective = build(spec)
    try:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        say(event="ready")
        result = None
        steady_kb = None
        for call in range(calls):
            if sys.stdin.readline().strip() != "go":
                return
            result = None  # one result alive at a time
            if spec["setup_call"] and call == 1:  # connections and threads are up
                steady_kb = resident_kb(reset_peak=True)
            tensor = (mine[:SETUP_NUMEL] if spec["setup_call"] and call == 0
                      else mine[:spec["warmup_numel"]] if call < spec["warmups"] else mine)
            started = time.monotonic()
            result, stats = collective.allreduce(tensor, call)
            seconds = time.monotonic() - started
            extra = {key: value for key, value in stats.extra.items()
                     if key in ("tcp_retransmits", "datagrams_lost", "rcvbuf_drops",
                                "chunks_missing", "datagrams_late", "deadline_seconds",
                                "broadcast_deadline_seconds", "rounds_incomplete",
                                "gather_seconds", "broadcast_seconds")}
            say(event="call", call=call, seconds=seconds, coverage=stats.coverage,
                bytes_sent=stats.bytes_sent, peers_missing=list(stats.peers_missing),
                extra=extra)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_kb = machine.status_kb("VmHWM")  # since the reset
        exact, error = compare(result, mean, mine) if result is not None else (False, math.nan)
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as default:
            namespace_default = default.read().strip()
        say(event="done", exact=exact, relative_error=error,
            extra_memory=(rss_after - rss_before) * 1024 / (numel * 4),
            call_memory=(math.nan if steady_kb is None or peak_kb is None
                         else (peak_kb - steady_kb) * 1024 / (numel * 4)),
            rss_before_mb=rss_before / 1024, rss_after_mb=rss_after / 1024,
            tcp=tcp_algorithms(), tcp_default=namespace_default)
    finally:
        collective.close()


# -- the parent: cells, labs, shaping -------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    kind: str
    numel: int
    rate: float | None  # bits/s on every downlink; None: unshaped
    loss: float
    quick: bool = field(default=False, compare=False)
    world: int = WORLD
    uplinks: bool = False  # the rate on every uplink too
    congestion: str = TCP_CONGESTION  # ring's and Moshpit's, per socket (--congestion)

    @property
    def bytes(self) -> int:
        return self.numel * 4

    @property
    def factor(self) -> float:
        """The tensors' worth each worker receives at least: 2(N-1)/N; for Moshpit one group
        all-reduce per axis of its grid (groups of four), 2(g-1)/g per side g."""
        if self.kind == "moshpit":
            return sum(2 * (side - 1) / side for side in Grid.for_world(self.world).sides)
        return 2 * (self.world - 1) / self.world

    @property
    def bound(self) -> float | None:
        """Seconds the bandwidth bound allows: `factor` tensors at the rate."""
        if self.rate is None:
            return None
        return self.factor * self.bytes * 8 / self.rate

    @property
    def call_timeout(self) -> float:
        """Seconds allowed per call: 10x the bound (1 Gbit/s's where unshaped; lossy's at its
        pacing cap where that is lower), 30..120."""
        rate = self.rate or 1e9
        if self.kind.startswith("lossy"):
            rate = min(rate, LOSSY_PACE_CAP)
        bound = self.factor * self.bytes * 8 / rate
        return min(max(10 * bound, 30.0), 120.0)

    @property
    def setup_call(self) -> bool:
        """Whether the first call is a SETUP_NUMEL one (counted among the warm-ups)."""
        return not self.kind.startswith("lossy")

    @property
    def warmups(self) -> int:
        """Lossy learns its deadlines from the last arrivals of earlier calls: three warm-ups
        where they are cheap; the others one, after their set-up call."""
        if self.kind.startswith("lossy"):
            return 3 if self.numel <= WARMUP_NUMEL else 1
        return 2

    @property
    def reps(self) -> int:
        return (QUICK_REPS if self.quick else REPS).get(self.numel, 1)

    @property
    def warmup_numel(self) -> int:
        return self.numel if self.kind.startswith("lossy") else min(self.numel, WARMUP_NUMEL)


@dataclass
class Outcome:
    cell: Cell
    status: str  # ok | timeout | failed | skipped
    seconds: list[float] = field(default_factory=list)  # per timed call: the slowest rank's
    warmup: float = math.nan
    coverage: float = math.nan  # mean over ranks and timed calls
    exact: bool = False
    relative_error: float = math.nan  # worst rank: |result - mean| / the inputs' rms offset
    extra_memory: float = math.nan  # worst rank, in tensor sizes, from the collective built
    call_memory: float = math.nan  # worst rank: the timed calls' peak over where they began
    tcp: dict[str, int] = field(default_factory=dict)
    tcp_default: str = ""
    counters: dict[str, float] = field(default_factory=dict)  # summed over ranks, timed calls
    cpu_busy: float = math.nan  # the host's CPUs during the timed calls: 1 - idle share
    note: str = ""
    wall: float = 0.0

    @property
    def time(self) -> float:
        return sum(self.seconds) / len(self.seconds) if self.seconds else math.nan

    @property
    def fraction(self) -> float:
        bound = self.cell.bound
        return bound / self.time if bound and self.seconds else math.nan


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


def shape(lab, rate: float | None, loss: float, uplinks: bool = False) -> None:
    from netem import apply
    from netem.profile import LinkProfile

    if rate is None and not loss:
        return
    spec: dict[str, Any] = {}
    if rate is not None:
        spec["rate"] = f"{int(rate)}bit"
    if loss:
        spec["loss"] = loss
    profile = LinkProfile.parse(spec)
    for host in lab.hosts:  # every host's downlink: the switch port towards it
        apply(host.switch_port, profile, netns=lab.switch, backend="fallback")
        if uplinks and rate is not None:  # and its uplink: its own port's egress
            apply(host.iface, LinkProfile.parse({"rate": spec["rate"]}), netns=host.netns,
                  backend="fallback")


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
            process = lab.popen(lab.hosts[rank], [sys.executable, "-m", "benchmarks.collectives",
                                                  "worker", json.dumps(spec)],
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


# -- the plan -------------------------------------------------------------------------------


def plan(quick: bool, kinds: Sequence[str] = KINDS, sizes: Sequence[str] | None = None,
         rates: Sequence[str] | None = None, losses: Sequence[float] | None = None,
         grid: Sequence[int] = (), grid_rate: float = GRID_RATE,
         ) -> list[tuple[float | None, float, list[Cell]]]:
    """(rate, loss, cells) per lab, in the order they run: smaller before larger, so a
    collective that timed out need not be tried where it can only be slower. `sizes`, `rates`
    (names, "unshaped" among them) and `losses` keep only the cells they name. With `grid`
    (worlds), only the grid cells of `kinds` (Moshpit, and the ring as a reference over the
    same links): one lab per world."""
    groups: list[tuple[float | None, float, list[Cell]]] = []
    if grid:
        numels = [SIZES["1M"], SIZES["10M"]]
        groups += [(grid_rate, 0.0, [Cell(k, n, grid_rate, 0.0, quick, world, True)
                                     for n in numels for k in kinds]) for world in grid]
    elif quick:
        numels = [SIZES["1M"], SIZES["10M"]]
        groups.append((None, 0.0, [Cell(k, n, None, 0.0, True) for n in numels for k in kinds]))
        for loss in (0.0, 0.10):
            groups.append((100e6, loss, [Cell(k, n, 100e6, loss, True)
                                         for n in numels for k in kinds]))
    else:
        groups.append((None, 0.0, [Cell(k, n, None, 0.0) for n in SIZES.values()
                                   for k in kinds]))
        for rate in RATES.values():
            for loss in LOSSES:
                # 100M (48 s per call at 100 Mbit/s) only at 0% and 10%: the budget's share.
                numels = [n for n in SIZES.values() if n < SIZES["100M"] or loss in (0.0, 0.10)]
                groups.append((rate, loss, [Cell(k, n, rate, loss) for n in numels
                                            for k in kinds]))
    kept = []
    for rate, loss, cells in groups:
        if ((rates is not None and rate_name(rate) not in rates)
                or (losses is not None and not any(math.isclose(loss, x) for x in losses))):
            continue
        cells = [c for c in cells if sizes is None or size_name(c.numel) in sizes]
        if cells:
            kept.append((rate, loss, cells))
    return kept


def hopeless(cell: Cell, outcomes: list[Outcome]) -> Outcome | None:
    """A timed-out outcome of this collective at the same rate with no more loss and no larger
    tensor: this cell would only be slower."""
    for o in outcomes:
        if (o.status == "timeout" and o.cell.kind == cell.kind and o.cell.rate == cell.rate
                and o.cell.loss <= cell.loss and o.cell.numel <= cell.numel):
            return o
    return None


# -- the report -----------------------------------------------------------------------------


def rate_name(rate: float | None) -> str:
    if rate is None:
        return "unshaped"
    return next((name for name, value in RATES.items() if value == rate), f"{rate:g} bit/s")


def size_name(numel: int) -> str:
    return next((name for name, value in SIZES.items() if value == numel), str(numel))


def show(o: Outcome | None, *, with_bound: bool = True) -> str:
    if o is None:
        return "-"
    if o.status == "skipped":
        return f"not run ({o.note})"
    if o.status == "timeout":
        return f"> {o.cell.call_timeout:.0f} s (timed out)"
    if o.status != "ok":
        return f"failed: {o.note}"
    text = f"{o.time:.3g} s"
    if with_bound and o.cell.bound:
        text += f" ({o.fraction:.2f})"
    if o.cell.kind.startswith(("lossy", "moshpit")) and o.coverage < 1:
        text += f" cov {o.coverage:.3f}"
    if o.cell.loss == 0 and not o.exact:
        text += " **inexact**" if o.coverage < 1 else " **WRONG**"
    return text


def ran(outcomes: list[Outcome]) -> list[str]:
    """The collectives this run measured, in the table's order."""
    return [kind for kind in KINDS if any(o.cell.kind == kind for o in outcomes)]


def tables(outcomes: list[Outcome]) -> list[str]:
    kinds = ran(outcomes)
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    out: list[str] = []
    header = "| size | " + " | ".join(kinds) + " |"
    rule = "| --- " * (len(kinds) + 1) + "|"
    unshaped = [o for o in outcomes if o.cell.rate is None]
    if unshaped:
        out += ["### Unshaped links (no rate, no loss): time per all-reduce, and gloo-bbr's "
                "time over it (> 1: faster than gloo)", "", header, rule]
        for numel in sorted({o.cell.numel for o in unshaped}):
            reference = by.get(("gloo-bbr", numel, None, 0.0))
            cells = []
            for kind in kinds:
                o = by.get((kind, numel, None, 0.0))
                text = show(o)
                if (o and o.status == "ok" and reference and reference.status == "ok"):
                    bus = o.cell.factor * o.cell.bytes * 8 / o.time / 1e9
                    text += f", x{reference.time / o.time:.2f} vs gloo, {bus:.2f} Gbit/s bus"
                cells.append(text)
            out.append(f"| {size_name(numel)} | " + " | ".join(cells) + " |")
        out.append("")
    for rate in [r for r in RATES.values() if any(o.cell.rate == r for o in outcomes)]:
        out += [f"### {rate_name(rate)} per downlink: time per all-reduce (fraction of the "
                "bandwidth bound)", "", "| size | loss | " + " | ".join(kinds) + " |",
                "| --- " * (len(kinds) + 2) + "|"]
        keys = sorted({(o.cell.numel, o.cell.loss) for o in outcomes if o.cell.rate == rate})
        for numel, loss in keys:
            bound = Cell("lossy", numel, rate, loss).bound
            cells = [show(by.get((kind, numel, rate, loss))) for kind in kinds]
            out.append(f"| {size_name(numel)} (bound {bound:.3g} s) | {loss:.0%} | "
                       + " | ".join(cells) + " |")
        out.append("")
        ratios = []
        for numel in sorted({o.cell.numel for o in outcomes if o.cell.rate == rate}):
            row = []
            for kind in kinds:
                row.append(ratio_text(by.get((kind, numel, rate, 0.0)),
                                      by.get((kind, numel, rate, 0.10))))
            if any(text != "-" for text in row):
                ratios.append(f"| {size_name(numel)} | " + " | ".join(row) + " |")
        if ratios:
            out += [f"Time at 10% loss over the same collective's time at 0% "
                    f"({rate_name(rate)}):", "", header, rule, *ratios, ""]
    memory = []
    for numel in sorted({o.cell.numel for o in outcomes}):
        row = []
        for kind in kinds:
            values = [o.extra_memory for o in outcomes if o.cell.kind == kind
                      and o.cell.numel == numel and o.status == "ok"]
            row.append(f"{max(values):.2f}" if values else "-")
        memory.append(f"| {size_name(numel)} | " + " | ".join(row) + " |")
    out += ["### Peak extra memory per worker, in tensor sizes (worst rank, worst cell)", "",
            "ru_maxrss after the calls minus before them (inputs and collective already built), "
            "over the tensor's bytes; the result itself is one tensor size. For small tensors "
            "fixed costs (allocator arenas, socket buffers, gloo's pairs) dominate the ratio.",
            "", header, rule,
            *memory, ""]
    return out


def ratio_text(clean: Outcome | None, lossy: Outcome | None) -> str:
    if clean is None or lossy is None:
        return "-"
    if clean.status != "ok":
        return "no 0% time"
    if lossy.status == "skipped":
        return "not run"
    if lossy.status == "timeout":
        return f"> {lossy.cell.call_timeout / clean.time:.3g}x"
    if lossy.status != "ok":
        return "failed"
    return f"{lossy.time / clean.time:.2f}x"


def targets(outcomes: list[Outcome]) -> list[tuple[bool | None, str]]:
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    lines: list[tuple[bool | None, str]] = []
    for numel in sorted({o.cell.numel for o in outcomes}):
        o = by.get(("lossy", numel, 100e6, 0.0))
        if o is not None:
            ok = o.status == "ok" and o.exact and o.fraction >= 0.9
            lines.append((ok, f"lossy, {size_name(numel)}, 100 Mbit/s, 0% loss: "
                          f"{o.fraction:.3f} of the bandwidth bound (target >= 0.9)"
                          + ("" if o.status == "ok" else f" [{show(o)}]")))
    for rate in RATES.values():
        for numel in sorted({o.cell.numel for o in outcomes}):
            clean, lossy = by.get(("lossy", numel, rate, 0.0)), by.get(("lossy", numel, rate, 0.1))
            if clean is None or lossy is None:
                continue
            ok = clean.status == lossy.status == "ok" and lossy.time <= 1.2 * clean.time
            lines.append((ok, f"lossy, {size_name(numel)}, {rate_name(rate)}: time at 10% loss "
                          f"/ time at 0% = {ratio_text(clean, lossy)} (target <= 1.2x)"))
    lossy_memory = [o for o in outcomes if o.cell.kind == "lossy" and o.status == "ok"]
    if lossy_memory:
        largest = max(o.cell.numel for o in lossy_memory)
        worst = max(o.extra_memory for o in lossy_memory if o.cell.numel == largest)
        lines.append((worst < 3, f"lossy, {size_name(largest)}: peak extra memory per worker "
                      f"{worst:.2f}x the tensor (target < 3x; worst cell)"))
    for kind in ("gloo-cubic", "gloo-bbr"):
        for rate in RATES.values():
            for numel in sorted({o.cell.numel for o in outcomes}):
                clean, lossy = by.get((kind, numel, rate, 0.0)), by.get((kind, numel, rate, 0.1))
                if clean is not None and lossy is not None:
                    lines.append((None, f"{kind}, {size_name(numel)}, {rate_name(rate)}: time "
                                  f"at 10% loss / time at 0% = {ratio_text(clean, lossy)} "
                                  "(beside lossy)"))
    wrong = [o for o in outcomes if o.status == "ok" and o.cell.loss == 0 and not o.exact]
    lines.append((not wrong, "every lossless cell that finished returned the true mean "
                  f"(tolerance {TOLERANCE:g})" + (": not in " + ", ".join(
                      f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)}"
                      for o in wrong) if wrong else "")))
    return lines


def observations(outcomes: list[Outcome]) -> list[str]:
    """Sentences drawn from the numbers of this run only."""
    by = {(o.cell.kind, o.cell.numel, o.cell.rate, o.cell.loss): o for o in outcomes}
    said: list[str] = []
    ok = [o for o in outcomes if o.status == "ok"]
    largest = max((o.cell.numel for o in ok), default=None)
    for rate in [r for r in RATES.values() if any(o.cell.rate == r for o in ok)]:
        clean = [o for o in ok if o.cell.rate == rate and o.cell.loss == 0
                 and o.cell.numel == largest]
        if clean:
            best = max(clean, key=lambda o: o.fraction)
            said.append(
                f"At {rate_name(rate)} without loss on {size_name(largest)} elements, "
                + ", ".join(f"{o.cell.kind} reached {o.fraction:.2f}" for o in clean)
                + f" of the bandwidth bound; {best.cell.kind} came closest.")
        for kind in ran(outcomes):
            ratios = [(numel, by.get((kind, numel, rate, 0.0)), by.get((kind, numel, rate, 0.1)))
                      for numel in SIZES.values()]
            shown = [f"{ratio_text(c, w)} on {size_name(n)}" for n, c, w in ratios
                     if c is not None and w is not None]
            if shown:
                said.append(f"{kind} at {rate_name(rate)}, 10% loss against 0%: "
                            + ", ".join(shown) + ".")
    timeouts = [o for o in outcomes if o.status == "timeout"]
    if timeouts:
        said.append("Timed out: " + ", ".join(
            f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)} "
            f"{o.cell.loss:.0%}" for o in timeouts) + ".")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        said.append("Failed: " + "; ".join(
            f"{o.cell.kind} {size_name(o.cell.numel)} {rate_name(o.cell.rate)} "
            f"{o.cell.loss:.0%}: {o.note}" for o in failed) + ".")
    lossy = [o for o in ok if o.cell.kind == "lossy" and o.cell.loss > 0]
    if lossy:
        said.append("lossy's coverage under loss ranged " + f"{min(o.coverage for o in lossy):.3f}"
                    f"-{max(o.coverage for o in lossy):.3f}; its worst rank's error |result - "
                    "mean| over the inputs' rms distance to the mean was at most "
                    f"{max(o.relative_error for o in lossy):.3f} (0: exact; 1: no better than "
                    "a typical input alone).")
    clean = [o for o in ok if o.cell.kind == "lossy" and o.cell.loss == 0]
    if clean:
        lost = sum(o.counters.get("datagrams_lost", 0) for o in clean)
        dropped = sum(o.counters.get("rcvbuf_drops", 0) for o in clean)
        late = sum(o.counters.get("datagrams_late", 0) for o in clean)
        if lost or late:
            said.append(f"On lossless links lossy's timed calls still counted {lost:.0f} "
                        f"datagrams lost ({dropped:.0f} of them in the receivers' socket "
                        "buffers, the rest on the way: the shaper's queue, or the bridge when "
                        f"unshaped) and {late:.0f} late, over {len(clean)} cells.")
        else:
            said.append(f"On lossless links lossy's timed calls lost no datagram and had none "
                        f"late ({len(clean)} cells).")
    gloo = [o for o in ok if o.cell.kind.startswith("gloo") and o.tcp]
    if gloo:
        seen = sorted({(o.cell.kind, algo) for o in gloo for algo in o.tcp})
        said.append("gloo's sockets (ss -ti in rank 0's namespace) ran: " + ", ".join(
            f"{kind}: {algo}" for kind, algo in seen) + ".")
    return said


def congestion_of(outcomes: list[Outcome]) -> str:
    """The ring's and Moshpit's congestion control in this run (`--congestion`)."""
    return outcomes[0].cell.congestion if outcomes else TCP_CONGESTION


def report(outcomes: list[Outcome], command: str, started: datetime.datetime,
           elapsed: float, note: str = "") -> str:
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
    verdicts = targets(outcomes)
    return "\n".join([
        "# Collectives: all-reduce among four workers on shaped links",
        "",
        *([f"**{note}**", ""] if note else []),
        machine.written_by(command, started, elapsed),
        "",
        "How: a lab of four namespaces on a bridge (MTU 1500, offloads off); every host's "
        "downlink (the switch port towards it) shaped with `netem.apply(..., "
        "backend=\"fallback\")`: htb at the rate with a 1000-packet fifo queue, nftables random "
        "drop for the loss (this kernel has no sch_netem). Each worker is its own process in "
        "its own namespace; the "
        "parent releases all four for each call, so every call starts together. Every "
        f"collective but lossy first makes a {SETUP_NUMEL:,}-element call that sets up its "
        "connections and threads; then one warm-up "
        f"call (on the first {WARMUP_NUMEL / 1e6:g}M elements for larger tensors, except "
        "lossy, which learns its deadlines from its warm-ups: three up to "
        f"{WARMUP_NUMEL / 1e6:g}M elements, one above), then timed calls ("
        + ", ".join(f"{size_name(n)}: {r}" for n, r in sorted(
            {o.cell.numel: o.cell.reps for o in outcomes}.items())) + "); "
        "time per all-reduce is the slowest rank's, averaged over the timed calls. Each call "
        "has a timeout of 10x the bound (lossy's: at its pacing), 30-120 s; a cell that timed "
        "out is killed, and the same collective is not tried at the same rate with more loss "
        "or a larger tensor. "
        "The inputs are `mean + c_r * noise` with the c_r summing to zero (no subset does), "
        f"so a lossless result must equal `mean` (tolerance {TOLERANCE:g}).",
        "",
        f"Collectives: `lossy` paced at {PACE:.2f}x the link rate, at most "
        f"{LOSSY_PACE_CAP / 1e6:g} Mbit/s per sender (its pace on unshaped links), each "
        "sender's chunks to its three peers interleaved, with its defaults otherwise: a "
        "phase ends once every sender's stream has ended (`settle`), and its "
        "deadline, a backstop, starts at 1.5x the paced phase time + 2 s (at most the call "
        "timeout / 2.5) and is learned from there; `lossy-keyed`: the same with the run's "
        "key (a 16-byte BLAKE2b MAC after every datagram's payload, checked before it is "
        "used, and proof of the key in every TCP hello); `ring` and `moshpit` (one group of "
        f"four) over TCP {congestion_of(outcomes)} per socket; `gloo-cubic` and `gloo-bbr`: "
        "torch.distributed gloo with the namespaces' default TCP congestion control set to "
        "cubic or bbr (cubic is allowed for the moment of the sysctl; host list: "
        f"`{allowed}`). The bandwidth bound is 2(N-1)/N x bytes / rate with N = 4; the "
        "fraction in brackets is bound / time. `cov` is the mean coverage (fraction of "
        "contributions in the result).",
        "",
        *tables(outcomes),
        "### Targets",
        "",
        *[f"- {'PASS' if ok else 'FAIL' if ok is False else 'info'}: {text}"
          for ok, text in verdicts],
        "",
        "### Observations (generated from this run's numbers)",
        "",
        " ".join(observations(outcomes)),
        "",
    ])


def grid_targets(outcomes: list[Outcome]) -> list[tuple[bool | None, str]]:
    lines: list[tuple[bool | None, str]] = []
    for o in outcomes:
        if o.cell.kind != "moshpit":
            if o.status == "ok":
                lines.append((None, f"{o.cell.kind}, {o.cell.world} peers, "
                              f"{size_name(o.cell.numel)}: {o.fraction:.3f} of its bound "
                              "(reference)"))
            continue
        where = (f"moshpit, {o.cell.world} peers, {size_name(o.cell.numel)}, "
                 f"{o.cell.rate / 1e6:g} Mbit/s")
        if o.status != "ok":
            lines.append((False, f"{where}: {show(o)}"))
            continue
        lines.append((o.fraction >= 0.85 and o.exact,
                      f"{where}: {o.fraction:.3f} of the grid's bandwidth bound, "
                      f"{'exact' if o.exact else 'NOT the exact mean'} (target >= 0.85, exact)"))
        lines.append((o.call_memory < 2, f"{where}: a call's peak extra memory "
                      f"{o.call_memory:.2f}x the tensor (target < 2x); {o.extra_memory:.2f}x "
                      "with the connections and threads its set-up call made"))
    return lines


def grid_report(outcomes: list[Outcome], command: str, started: datetime.datetime,
                elapsed: float, note: str = "") -> str:
    rows = ["| collective | peers | grid | rate | size | bound | time per all-reduce | of the "
            "bound | exact | slowest call | call memory | with set-up | host CPU busy |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: "
            "| ---: |"]
    for o in outcomes:
        sides = ("x".join(map(str, Grid.for_world(o.cell.world).sides))
                 if o.cell.kind == "moshpit" else "ring")
        slowest = f"{max(o.seconds):.3g} s" if o.seconds else "-"
        rows.append(f"| {o.cell.kind} | {o.cell.world} | {sides} | {o.cell.rate / 1e6:g} Mbit/s | "
                    f"{size_name(o.cell.numel)} | "
                    f"{o.cell.bound:.3g} s | {show(o, with_bound=False)} | "
                    f"{o.fraction:.2f} | {'yes' if o.exact else 'no'} | {slowest} | "
                    f"{o.call_memory:.2f} | {o.extra_memory:.2f} | {o.cpu_busy:.0%} |")
    return "\n".join([
        "# Moshpit on a grid: groups of four, the same rate each way on every peer",
        "",
        *([f"**{note}**", ""] if note else []),
        machine.written_by(command, started, elapsed),
        "",
        "How: a lab of N namespaces on a bridge (MTU 1500, offloads off); every peer's downlink "
        "(the switch port towards it) and uplink (its own port's egress) shaped to the rate "
        "of the table (`--grid-rate`, 100 Mbit/s unless said) with `netem.apply(..., "
        "backend=\"fallback\")` (htb, this kernel has no sch_netem), no loss. Each peer is "
        "its own process in its own namespace, Moshpit over TCP "
        f"{congestion_of(outcomes)} with `group_size` {GRID_GROUP}: N = 8 sits on a 4x2 grid, "
        f"N = 16 on 4x4. A {SETUP_NUMEL:,}-element set-up call, one warm-up call, then timed "
        "calls (1M: 5, 10M: 2); the time is the "
        "slowest peer's, averaged over the timed calls; the call's deadline (`timeout`) is 10x the "
        "bound, 30-120 s. Moshpit's bound is one group all-reduce per grid axis: each peer "
        "receives 2(g-1)/g of the tensor per side g (4x2: 2.5 tensors; 4x4: 3), at the rate; "
        "the ring (reliable ring all-reduce over TCP, one stream in and one out per worker) "
        "runs on the same links as a reference for what TCP reaches there, against its own "
        "bound, 2(N-1)/N tensors. The "
        "inputs are `mean + c_r * noise` with the c_r summing to zero and no proper subset "
        f"doing so (`offsets`): the result must equal `mean` (tolerance {TOLERANCE:g}). Memory, "
        "over the tensor's bytes, worst peer (the result itself is one tensor): `call "
        "memory` is the peak resident size over the warm-up and timed calls (VmHWM, reset as "
        "they begin) over the resident size they began at, once the set-up call had made "
        "the connections and threads; `with set-up` is ru_maxrss after the calls over before "
        "the set-up call, the collective already built: it adds those fixed costs, a few MB "
        "whatever the tensor.",
        "",
        *rows,
        "",
        "### Targets",
        "",
        *[f"- {'PASS' if ok else 'FAIL' if ok is False else 'info'}: {text}"
          for ok, text in grid_targets(outcomes)],
        "",
    ])


def progress(outcome: Outcome, count: str, elapsed: float) -> None:
    cell = outcome.cell
    note = f" [{outcome.note}]" if outcome.note and outcome.status != "skipped" else ""
    phases = outcome.counters if outcome.status == "ok" else {}
    if "gather_seconds" in phases:
        note += (f" [slowest gather {phases['gather_seconds']:.3g} s, broadcast "
                 f"{phases['broadcast_seconds']:.3g} s]")
    print(f"[{count} {elapsed / 60:.1f} min] {rate_name(cell.rate)}, loss {cell.loss:.0%}, "
          f"{size_name(cell.numel)}, {cell.kind}: {show(outcome)}{note} ({outcome.wall:.0f} s)",
          file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1M and 10M, 100 Mbit/s at 0%% and 10%% loss, and unshaped")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated collectives to run (default: {','.join(KINDS)})")
    parser.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
    parser.add_argument("--rates", help="comma-separated, of " + ", ".join(
        [*(name.replace(" ", "") for name in RATES), "unshaped"]) + " (default: all)")
    parser.add_argument("--losses", help="comma-separated loss percentages, of "
                        + ",".join(f"{x * 100:g}" for x in LOSSES) + " (default: all)")
    parser.add_argument("--logs", type=Path,
                        help="keep every worker's output (one JSON line per call) here")
    parser.add_argument("--grid", nargs="?", const=",".join(map(str, GRID_WORLDS)),
                        help="only Moshpit on a grid of groups of four, with these many peers "
                        f"(default {','.join(map(str, GRID_WORLDS))}), every peer's downlink "
                        "and uplink at 100 Mbit/s, 1M and 10M")
    parser.add_argument("--grid-rate", type=float, default=GRID_RATE / 1e6,
                        help="--grid: Mbit/s on every downlink and uplink (default %(default)g)")
    parser.add_argument("--congestion", default=TCP_CONGESTION,
                        help="TCP congestion control of the ring's and Moshpit's sockets "
                        "(default %(default)s; one of the kernel's available ones)")
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
        return
    args = parser.parse_args()
    if args.grid and args.kinds == parser.get_default("kinds"):
        args.kinds = ",".join(GRID_KINDS)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds: expected some of {', '.join(KINDS)}, got {args.kinds!r}")
    sizes = _choices(parser, "--sizes", args.sizes, list(SIZES))
    rate_names = {name.replace(" ", ""): name for name in RATES} | {"unshaped": "unshaped"}
    rates = _choices(parser, "--rates", args.rates, list(rate_names))
    rates = None if rates is None else [rate_names[r] for r in rates]
    percents = _choices(parser, "--losses", args.losses, [f"{x * 100:g}" for x in LOSSES])
    losses = None if percents is None else [float(p) / 100 for p in percents]
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and shaping")
    from netem.lab import Lab

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through every cleanup below, as Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    command = machine.command("benchmarks.collectives")
    started_at = datetime.datetime.now(datetime.UTC)
    started = time.monotonic()
    try:
        grid = [int(x) for x in args.grid.split(",")] if args.grid else []
    except ValueError:
        parser.error(f"--grid: expected comma-separated peer counts, got {args.grid!r}")
    write = grid_report if grid else report
    if grid and args.out == RESULTS:
        args.out = GRID_RESULTS
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    if args.congestion not in available:
        parser.error(f"--congestion: expected one of {', '.join(available)} (this kernel's), "
                     f"got {args.congestion!r}")
    groups = [(rate, loss, [replace(cell, congestion=args.congestion)
                            for cell in cells])
              for rate, loss, cells in plan(args.quick, kinds, sizes, rates, losses, grid,
                                            args.grid_rate * 1e6)]
    if not groups:
        parser.error("no cell left to run: --sizes, --rates and --losses exclude them all")
    total = sum(len(cells) for _, _, cells in groups)
    outcomes: list[Outcome] = []
    port = 30000
    try:
        with tempfile.TemporaryDirectory(prefix="tb-collectives-") as tmp:
            logs = args.logs or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            for rate, loss, cells in groups:
                with Lab(cells[0].world, mtu=MTU) as lab:
                    shape(lab, rate, loss, cells[0].uplinks)
                    for cell in cells:
                        earlier = hopeless(cell, outcomes)
                        if earlier is not None:
                            outcome = Outcome(cell, "skipped", note=(
                                f"timed out at {size_name(earlier.cell.numel)}, "
                                f"{earlier.cell.loss:.0%}"))
                        else:
                            outcome = run_cell(lab, cell, port, logs)
                            port += 10
                        outcomes.append(outcome)
                        progress(outcome, f"{len(outcomes)}/{total}", time.monotonic() - started)
    except KeyboardInterrupt:
        if outcomes:  # what finished is kept, beside the results, never over them
            partial = args.out.with_suffix(".partial.md")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(write(outcomes, command, started_at, time.monotonic() - started,
                                     note=f"Interrupted after {len(outcomes)} of {total} "
                                     "cells: a partial run."))
            print(f"interrupted; wrote {partial}", file=sys.stderr)
        raise SystemExit(130) from None
    text = write(outcomes, command, started_at, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    for ok, line in (grid_targets if grid else targets)(outcomes):
        print(f"{'PASS' if ok else 'FAIL' if ok is False else 'info'}: {line}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)


def _choices(parser: argparse.ArgumentParser, flag: str, value: str | None,
             allowed: list[str]) -> list[str] | None:
    """A comma-separated flag's values, each one of `allowed`; None when not given."""
    if value is None:
        return None
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}: expected some of {', '.join(allowed)}, got {value!r}")
    return chosen


if __name__ == "__main__":
    main()
