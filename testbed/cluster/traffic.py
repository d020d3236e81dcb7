"""Background flows that compete with training for the links (a scenario's `traffic:`).

Each flow is iperf3: a server in the receiving worker's namespace (or container), started
before the flows' clock, and a client in the sending worker's, started at the flow's `start`,
ended at its `stop` (or when the run ends), and for an on/off UDP flow started for each burst
and ended after `on` seconds. They cross the same shaped links as the job, so they fill the
same queues. The servers report every `REPORT_INTERVAL` what they received; each report goes
to the receiver's status file (its worker's metrics, `testbed.metrics.traffic`) and to
`on_interval` (the run's records). A client that ends before its time (its server not up
yet, a link cut long enough for iperf3 to give up) is started again after `RETRY` seconds,
counted in the flow's `restarts`; so is one that has not said it is connected within
`CONNECT_WAIT` (iperf3 3.12 sends a UDP test's one set-up datagram once, and waits for its
answer forever when the link loses either).

One `CrossTraffic` serves both placements: the namespace runner runs every flow's two ends
(`here` prefixes a command with `ip netns exec`); a Compose node runs the ends of the flows
that leave or enter its worker (`ranks`). Every process started is a child of this one, ended
by `stop` (and by the kernel, with `setpriv --pdeathsig`, should this process die first).
"""

from __future__ import annotations

import math
import re
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from testbed.metrics.traffic import status_path, write_status
from testbed.scenario.traffic import UDP, Flow

IPERF3 = "iperf3"
FIRST_PORT = 5201  # flow i's server listens on FIRST_PORT + i (iperf3's own default first)
REPORT_INTERVAL = 0.1  # seconds between a server's reports (iperf3's least): what a client
# ended at its stop takes with it, unreported
RECORD_EVERY = 1.0  # seconds of reports summed into one record of the run (`on_interval`)
RETRY = 0.5  # seconds before a client that ended early is started again
LISTEN_WAIT = 10.0  # seconds a server gets to say it listens
STOP_WAIT = 5.0  # seconds a process gets to end after SIGTERM before SIGKILL
# seconds a client gets to say it is connected (its control connection's SYN lost twice on a
# lossy link takes 3 s) before it is ended and started again
CONNECT_WAIT = 6.0
CONNECTED = " connected to "  # in iperf3's "[  5] local A port P connected to B port Q"
ORPHAN_GUARD = ["setpriv", "--pdeathsig", "TERM", "--"]


def server_argv(port: int) -> list[str]:
    """An iperf3 server on `port` reporting in Kbit/s every `REPORT_INTERVAL`, each report
    flushed at once."""
    return [IPERF3, "--server", "--port", str(port), "--interval", f"{REPORT_INTERVAL:g}",
            "--forceflush", "--format", "k"]


def client_argv(flow: Flow, address: str, port: int, send_bytes: int | None = None) -> list[str]:
    """An iperf3 client sending `flow` to `address`:`port` until it is ended (`--time 0`), or
    until it sent `send_bytes` (an on/off flow's burst, which so ends cleanly: its receiver
    reports all of it)."""
    until = ["--time", "0"] if send_bytes is None else ["--bytes", str(send_bytes)]
    argv = [IPERF3, "--client", address, "--port", str(port), *until,
            "--interval", "0", "--format", "k"]
    if flow.kind == UDP:
        argv += ["--udp", "--bitrate", str(flow.rate)]
    elif flow.congestion is not None:
        argv += ["--congestion", flow.congestion]
    return argv


@dataclass(frozen=True)
class Interval:
    """One report of a server: what it received from `start` to `end` seconds of its test,
    and for UDP the datagrams lost and sent in it."""

    start: float
    end: float
    bytes: float
    lost: int | None = None
    total: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def __add__(self, later: Interval) -> Interval:
        def add(a: int | None, b: int | None) -> int | None:
            return None if a is None and b is None else (a or 0) + (b or 0)

        return Interval(self.start, later.end, self.bytes + later.bytes,
                        add(self.lost, later.lost), add(self.total, later.total))


_INTERVAL = re.compile(
    r"^\[\s*\d+\]\s+(?P<start>\d+(?:\.\d+)?)-(?P<end>\d+(?:\.\d+)?)\s+sec\s+\S+\s+\w*Bytes\s+"
    r"(?P<rate>\d+(?:\.\d+)?)\s+Kbits/sec(?:\s+\S+\s+ms\s+(?P<lost>-?\d+)/(?P<total>\d+))?")


def parse_interval(line: str) -> Interval | None:
    """A server's interval report (`--format k`), or None for any other line (headers, the
    sums after a test that end in `sender`/`receiver`)."""
    if line.rstrip().endswith(("sender", "receiver")):
        return None
    match = _INTERVAL.match(line)
    if match is None:
        return None
    start, end = float(match["start"]), float(match["end"])
    received = float(match["rate"]) * 1000 / 8 * (end - start)
    lost = None if match["lost"] is None else max(0, int(match["lost"]))
    total = None if match["total"] is None else int(match["total"])
    return Interval(start, end, received, lost, total)


@dataclass
class FlowState:
    """One flow as this process runs it, and what its receiver reported so far."""

    name: str
    flow: Flow
    port: int
    received_bytes: float = 0.0
    lost_datagrams: int = 0
    seconds: float = 0.0  # of the intervals reported
    active: bool = False  # a test is running on its server
    bursts: int = 0  # clients started for their time (on/off: one per burst)
    restarts: int = 0  # clients started again after ending early
    tests_end: float = 0.0  # the end of the last interval counted in the server's test
    pending: Interval | None = None  # reports not yet recorded (`RECORD_EVERY`)

    def status(self) -> dict[str, Any]:
        return {"peer": self.flow.src, "kind": self.flow.kind, "active": self.active,
                "received_bytes": self.received_bytes, "lost_datagrams": self.lost_datagrams}

    def take(self, line: str) -> Interval | None:
        """Follow the server's output: a test begins with `Accepted connection` and ends with
        the sums' rule (or the next `Server listening`, when its client was ended); each
        interval counts once (iperf3 repeats the last when a client is ended). Returns the
        reports to record: at least `RECORD_EVERY` seconds of them, or the rest at a test's
        end."""
        if line.startswith("Accepted connection"):
            self.active, self.tests_end = True, 0.0
            return None
        if line.startswith(("- - -", "Server listening")):
            self.active = False
            pending, self.pending = self.pending, None
            return pending
        interval = parse_interval(line)
        if interval is None or not self.active or interval.end <= self.tests_end:
            return None
        self.tests_end = interval.end
        self.received_bytes += interval.bytes
        self.lost_datagrams += interval.lost or 0
        self.seconds += interval.seconds
        self.pending = interval if self.pending is None else self.pending + interval
        if self.pending.seconds < RECORD_EVERY:
            return None
        pending, self.pending = self.pending, None
        return pending


class CrossTraffic:
    """Run `flows` (name -> flow) between the workers: the ends of those that leave or enter
    one of `ranks` (None: every end), each command prefixed with `here(rank)` (what runs it
    where that worker is), the clients towards `address_of(rank)`. `start` starts the servers
    and the clock; `stop` ends everything (idempotent)."""

    def __init__(self, flows: Mapping[str, Flow], *, run_dir: Path,
                 address_of: Callable[[int], str],
                 here: Callable[[int], list[str]] = lambda rank: [],
                 ranks: Collection[int] | None = None,
                 on_interval: Callable[[str, Interval], None] = lambda name, interval: None
                 ) -> None:
        self.run_dir, self.address_of, self.here = run_dir, address_of, here
        self.on_interval = on_interval
        mine = (lambda rank: True) if ranks is None else (lambda rank: rank in ranks)
        self.flows = [FlowState(name, flow, FIRST_PORT + index)
                      for index, (name, flow) in enumerate(flows.items())]
        self._receiving = [state for state in self.flows if mine(state.flow.dst)]
        self._sending = [state for state in self.flows if mine(state.flow.src)]
        self.origin: float | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen[str]] = set()
        self._threads: list[threading.Thread] = []
        self._logs: dict[str, IO[str]] = {}  # each flow's log, shared by its processes

    def __bool__(self) -> bool:
        return bool(self._receiving or self._sending)

    def start(self, elapsed: float = 0.0) -> CrossTraffic:
        """Start the servers (each listening before this returns) and then each flow's clock:
        `elapsed` seconds since training started (a Compose worker that rejoins a run)."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for state in self._receiving:
            server = self._spawn(state.flow.dst, server_argv(state.port), state.name,
                                 read=True)
            self._await_listening(state, server)
            self._thread(self._receive, state, server)
        self._report()
        self.origin = time.monotonic() - max(elapsed, 0.0)
        for state in self._sending:
            self._thread(self._send, state)
        return self

    def stop(self) -> None:
        """End every client and server, and wait for their threads."""
        self._stopping.set()
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            _end(process)
        for thread in self._threads:
            thread.join()
        for state in self.flows:
            state.active = False
        self._report()
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def summary(self) -> dict[str, Any]:
        """Per flow this process received or sent: its figures, for the run's records."""
        return {state.name: {
            "from": state.flow.src, "to": state.flow.dst, "kind": state.flow.kind,
            "description": state.flow.describe(), "received_bytes": state.received_bytes,
            "seconds": state.seconds, "lost_datagrams": state.lost_datagrams,
            "bits_per_second": (state.received_bytes * 8 / state.seconds
                                if state.seconds else 0.0),
            "bursts": state.bursts, "restarts": state.restarts,
        } for state in self.flows if state in self._receiving or state in self._sending}

    # -- processes

    def _spawn(self, rank: int, argv: list[str], name: str, *,
               read: bool = False) -> subprocess.Popen[str]:
        """Run `argv` where worker `rank` is; its output goes to the flow's log, or (`read`)
        its standard output to a pipe."""
        with self._lock:
            log = self._logs.get(name)
            if log is None:
                log = self._logs[name] = (self.run_dir / "logs" / f"traffic-{name}.log").open(
                    "a", buffering=1)
        process = subprocess.Popen([*ORPHAN_GUARD, *self.here(rank), *argv], text=True,
                                   stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE if read else log, stderr=log,
                                   bufsize=1)
        with self._lock:
            self._processes.add(process)
        if self._stopping.is_set():  # stop came while it started: it would be missed
            _end(process)
        return process

    def _await_listening(self, state: FlowState, server: subprocess.Popen[str]) -> None:
        """Read the server's first lines until it says it listens, so clients started now
        find it; one that says nothing within `LISTEN_WAIT` is ended."""
        assert server.stdout is not None
        guard = threading.Timer(LISTEN_WAIT, _end, [server])
        guard.start()
        try:
            for line in server.stdout:
                if line.startswith("Server listening"):
                    return
        finally:
            guard.cancel()
        _end(server)
        raise RuntimeError(f"traffic {state.name}: iperf3's server on worker {state.flow.dst} "
                           f"port {state.port} did not start (see logs/traffic-{state.name}.log)")

    def _thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"traffic {args[0].name}")
        self._threads.append(thread)
        thread.start()

    def _receive(self, state: FlowState, server: subprocess.Popen[str]) -> None:
        assert server.stdout is not None
        for line in server.stdout:
            was, received = state.active, state.received_bytes
            interval = state.take(line)
            if interval is not None:
                self.on_interval(state.name, interval)
            if state.received_bytes != received or state.active != was:
                self._report(state.flow.dst)

    def _report(self, rank: int | None = None) -> None:
        """Each receiver's status file (`rank`'s only, if given), from the flows into it."""
        with self._lock:
            for dst in sorted({s.flow.dst for s in self._receiving}):
                if rank is None or dst == rank:
                    write_status(status_path(self.run_dir, dst), {
                        s.name: s.status() for s in self._receiving if s.flow.dst == dst})

    def _send(self, state: FlowState) -> None:
        """The flow's client from its start to its stop: one that sends until it is ended, or
        for an on/off flow one per burst, which sends `on` seconds' worth at the rate and ends
        by itself (its setting up counts into the silence, not the burst)."""
        assert self.origin is not None
        flow = state.flow
        end = math.inf if flow.stop is None else self.origin + flow.stop
        if self._stopping.wait(max(0.0, self.origin + flow.start - time.monotonic())):
            return
        address = self.address_of(flow.dst)
        if flow.on is None or flow.off is None:
            argv = client_argv(flow, address, state.port)
            while time.monotonic() < end:
                state.bursts += state.bursts == 0
                self._run_client(state, argv, end)
                if self._stopping.is_set() or time.monotonic() >= end:
                    return
                state.restarts += 1  # ended before its time: again, in a moment
                if self._stopping.wait(RETRY):
                    return
            return
        burst = client_argv(flow, address, state.port, round((flow.rate or 0) * flow.on / 8))
        while time.monotonic() < end:
            state.bursts += 1
            if not self._run_client(state, burst, end) and not self._stopping.is_set():
                state.restarts += 1  # never connected: the next burst comes as usual
            if self._stopping.wait(min(flow.off, max(0.0, end - time.monotonic()))):
                return

    def _run_client(self, state: FlowState, argv: list[str], end: float) -> bool:
        """Run one client until it ends or `end` (monotonic) comes, its output copied to the
        flow's log; one that has not said it is connected within `CONNECT_WAIT` is ended.
        Whether it connected."""
        client = self._spawn(state.flow.src, argv, state.name, read=True)
        assert client.stdout is not None
        connected = threading.Event()
        timers = [threading.Timer(CONNECT_WAIT, lambda: connected.is_set() or _end(client))]
        if end != math.inf:
            timers.append(threading.Timer(max(0.0, end - time.monotonic()), _end, [client]))
        for timer in timers:
            timer.start()
        log = self._logs[state.name]
        try:
            for line in client.stdout:
                log.write(line)
                if CONNECTED in line:
                    connected.set()
        finally:
            for timer in timers:
                timer.cancel()
            _end(client)
            with self._lock:
                self._processes.discard(client)
        return connected.is_set()


def _end(process: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if it does not end within `STOP_WAIT`; reaped."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
