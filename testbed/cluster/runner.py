"""`testbed run`: one scenario end to end on this host.

The network of the scenario (`ClusterNetwork`: a namespace per worker, every directed pair
shaped), one worker process per namespace (`python -m testbed.cluster.worker SPEC.json`), the
fault timeline driven by time and by the slowest worker's step, and the run directory
(`testbed.report`): the scenario, every event, the summary, the plots. Each worker reports a
JSON line per step on its stdout; the runner turns them into `WorkerState`s for a live display.
Links the scenario captures are recorded from before the workers start until they ended
(`testbed.cluster.capture`). Everything the run made goes on success, failure and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.cluster import zygote
from testbed.cluster.capture import RunCapture
from testbed.cluster.network import ClusterNetwork
from testbed.cluster.relay import TARGETS_FILE, MetricsRelay
from testbed.cluster.replay import LinkReplay
from testbed.cluster.timeline import Timeline
from testbed.cluster.traffic import CrossTraffic
from testbed.cluster.worker import (
    PORTS,
    WorkerSpec,
    post_burst,
    post_fault,
    post_links,
)
from testbed.cluster.zygote import ForkedWorker, Zygote
from testbed.report import RunWriter
from testbed.scenario import Scenario, load_scenario
from testbed.scenario.timeline import Event
from testbed.transport.auth import write_key

STOP_GRACE = 10.0  # seconds a worker gets to end after SIGTERM before SIGKILL
POLL = 0.2  # seconds between looks at the workers when none of them says anything
LINK_PROBES = 1000  # probes per link with `metrics.probe_links` (0.4 s a link, plus its delay)
PROMETHEUS_TARGETS = TARGETS_FILE  # file_sd of the workers' relayed endpoints
KEY_FILE = "run.key"  # the run's secret, while it runs (mode 0600), where it authenticates


class RunTimeout(TimeoutError):
    """`ClusterRun.run(timeout=...)` ran out of time (the run was ended and cleaned up)."""


@dataclass
class WorkerState:
    """What the runner knows of one worker, from its last report."""

    rank: int
    status: str = "starting"  # starting, running, done, failed, killed
    step: int = -1
    loss: float = math.nan
    step_seconds: float = math.nan
    coverage: float = math.nan
    datagrams_lost: float = 0.0  # since the run began (the others: its last step's)
    drift: float | None = None
    exit_code: int | None = None
    evaluation: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    ready: bool = False  # set up and past the start barrier: training began
    finished: bool = False  # said it is done: its training ended (it may still clean up)
    lingering: bool = False  # done, and serving /metrics until told to end (metrics.linger)
    # A command job's: its process group, when it started (monotonic), how long it ran.
    command_pid: int | None = None
    started: float | None = None
    seconds: float | None = None


@dataclass
class RunResult:
    run_dir: Path
    success: bool
    seconds: float
    workers: list[WorkerState]
    summary: dict[str, Any]
    html: Path | None
    error: str | None = None


class ClusterRun:
    """One run of `scenario_path` (its steps overridden by `steps`, e.g. to shorten it in CI)
    into `run_dir` (default: `runs/<name>-<UTC time>`), capturing the scenario's links and
    `capture` ("0->1", ...: `Scenario.with_capture`, a `ValueError` names a bad one). With
    `report` false the run draws no report (`testbed report RUN_DIR` draws it later)."""

    def __init__(
        self,
        scenario_path: str | Path,
        *,
        steps: int | None = None,
        run_dir: str | Path | None = None,
        backend: str = "auto",
        capture: Sequence[str] | None = None,
        report: bool = True,
    ) -> None:
        self.scenario_path = Path(scenario_path)
        self.report = report
        self.steps = steps
        self.scenario: Scenario = load_scenario(self.scenario_path, steps=steps).with_capture(
            list(capture or ()))
        self.capture: RunCapture | None = None  # the run's captures, once the network is up
        self.shaped_by: str | None = None  # the backend that shapes the links, once they are
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        self.run_dir = (Path(run_dir) if run_dir
                        else Path("runs") / f"{safe_name(self.scenario.name)}-{stamp}")
        self.backend = backend
        self.workers = [WorkerState(rank) for rank in range(self.scenario.count)]
        self._processes: dict[int, ForkedWorker] = {}
        self._zygote: Zygote | None = None
        self._killed: set[int] = set()
        self._released: set[int] = set()  # pids of lingering workers told to end
        self._late: set[int] = set()  # restarted after the others ended: done, nothing to do
        self._reports: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self._lock = threading.Lock()
        self.metrics_urls: list[str] = []  # each worker's /metrics, as seen from the host
        self.program_metrics_urls: list[str] = []  # a command job's own, where it names a port
        self._deadline: float | None = None
        self._timeout: float | None = None
        self._interrupted = _Interrupt()

    def worker_pids(self) -> dict[int, int]:
        """The pid of each worker process started so far (the latest of a restarted one)."""
        with self._lock:
            return {rank: process.pid for rank, process in self._processes.items()}

    def run(self, on_update: Callable[[list[WorkerState]], None] = lambda _: None, *,
            timeout: float | None = None) -> RunResult:
        """Run to the end (or the first Ctrl-C or SIGTERM, which ends the run cleanly and is
        re-raised as `Interrupted`).
        With `timeout` (seconds from now), a run still going then is ended the same way and
        `RunTimeout` raised; the run directory says so."""
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        with _interrupts_at_safe_points() as self._interrupted:
            return self._run(on_update)

    def _run(self, on_update: Callable[[list[WorkerState]], None]) -> RunResult:
        started = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        text = self.scenario_path.read_text()
        (self.run_dir / "logs").mkdir(exist_ok=True)
        writer = RunWriter.create(self.run_dir, scenario=text, name=self.scenario.name)
        error: str | None = None
        try:
            with (ClusterNetwork(self.scenario, backend=self.backend) as network,
                  contextlib.ExitStack() as stack):
                self.shaped_by = network.backend
                writer.event("cluster", prefix=network.prefix, hosts=network.hosts,
                             congestion=network.congestion, backend=network.backend,
                             seeds=network.seeds())
                if self.scenario.metrics.probe_links:
                    self._probe_links(network, writer)
                self._write_specs(network)
                stack.enter_context(self._relay(network, writer))
                zygote_log = str((self.run_dir / "logs" / "zygote.log").resolve())
                self._zygote = zygote.acquire(
                    lambda rank, report: self._reports.put((rank, report)), zygote_log)
                stack.callback(zygote.release, self._zygote)
                # On the bridge, never shaped; served until the workers are gone.
                store = self._zygote.serve_store(network.control_address, PORTS["drift"],
                                                 network.lab.switch, zygote_log)
                stack.callback(_stop, [store])
                if self.scenario.capture_pairs():
                    self.capture = RunCapture(self.scenario, self.run_dir, writer.started)
                    stack.callback(self.capture.close, network)  # once the workers are gone
                    self.capture.start(network)
                def on_event(record: dict[str, Any]) -> None:
                    writer.fault(**record)
                    # The workers' metrics: the links' profiles, and the fault for every worker.
                    post_links(self.run_dir, record, network.links.effective)
                    post_fault(self.run_dir, record, writer.started + record["t"],
                               range(self.scenario.count))

                timeline = Timeline(
                    self.scenario.timeline, network, on_event,
                    on_kill=self._kill, on_restart=self._restart,
                    on_straggler_burst=self._burst,
                )
                # The traced links' workers' metrics follow each change, as a timeline's do.
                replay = LinkReplay(network, self.scenario.traces(), on_change=lambda pairs, _: (
                    post_links(self.run_dir, {"pairs": pairs}, network.links.effective)))
                traffic = CrossTraffic(
                    self.scenario.flows(), run_dir=self.run_dir,
                    address_of=lambda rank: network.hosts[rank],
                    here=lambda rank: ["ip", "netns", "exec", network.namespace(rank)],
                    on_interval=lambda name, interval: writer.event(
                        "traffic", flow=name, seconds=interval.seconds, bytes=interval.bytes,
                        lost=interval.lost))
                for rank in range(self.scenario.count):
                    self._check_interrupt()
                    self._start(rank)
                try:
                    self._follow(timeline, replay, traffic, writer, on_update)
                finally:
                    timeline.stop()
                    traffic.stop()
                    if traffic.origin is not None:
                        writer.event("cross_traffic", flows=traffic.summary())
                    try:
                        replay.stop()
                    finally:
                        if replay and replay.origin is not None:
                            writer.event("replay", **replay.summary())
                        self._stop_all()
        except KeyboardInterrupt as interrupt:
            error = ("terminated (SIGTERM)" if getattr(interrupt, "signum", None)
                     == signal.SIGTERM else "interrupted (Ctrl-C)")
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            failed = [w for w in self.workers if w.status != "done"]
            if error is None and failed:
                error = "; ".join(self._failure(w) for w in failed)
            if self.capture is not None:
                self.capture.summarise()
                writer.event("capture", **self.capture.event())
            (self.run_dir / KEY_FILE).unlink(missing_ok=True)  # of no use once the run is over
            summary = writer.finish(success=error is None, error=error)
            writer.close()
            html = render(self.run_dir) if self.report else None
            self.result = RunResult(self.run_dir, error is None, time.monotonic() - started,
                                    self.workers, summary, html, error)
        return self.result

    def _check_interrupt(self) -> None:
        """Raise `Interrupted` here, at a safe point, if Ctrl-C or SIGTERM came meanwhile."""
        if self._interrupted.signum is not None:
            raise Interrupted(self._interrupted.signum)

    def _relay(self, network: ClusterNetwork,
               writer: RunWriter) -> contextlib.AbstractContextManager[Any]:
        """Every worker's /metrics on the host's loopback (`metrics_urls`), and a Prometheus
        file_sd document of them in the run directory; none when the workers pick their port.
        A command job's own metrics port is relayed too (`program_metrics_urls`), its targets
        labelled `source: program`."""
        port = self.scenario.metrics.port
        if not port:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        namespaces = [network.namespace(r) for r in range(self.scenario.count)]
        labels = {"scenario": self.scenario.name, "run": self.run_dir.name}
        relay = stack.enter_context(MetricsRelay(namespaces, network.hosts, port))
        self.metrics_urls = relay.urls()
        targets = relay.targets({**labels, "source": "testbed"})
        own = self.scenario.command.metrics_port if self.scenario.command else None
        if own is not None:
            program = stack.enter_context(MetricsRelay(namespaces, network.hosts, own))
            self.program_metrics_urls = program.urls()
            targets += program.targets({**labels, "source": "program"})
        (self.run_dir / PROMETHEUS_TARGETS).write_text(json.dumps(targets, indent=2) + "\n")
        writer.event("metrics", urls=self.metrics_urls, program_urls=self.program_metrics_urls,
                     targets=PROMETHEUS_TARGETS)
        return stack

    # -- workers ---------------------------------------------------------------------------

    def _write_specs(self, network: ClusterNetwork) -> None:
        """Every worker's spec, and the run's secret where the scenario authenticates: a
        file only this user may read, which the specs name (the secret is in no spec, log,
        event or metric)."""
        scenario_copy = self.run_dir / "scenario.yaml"
        run_id = int.from_bytes(os.urandom(4), "big")
        key_file = None
        if self.scenario.authenticates("namespaces"):
            key_file = self.run_dir / KEY_FILE
            write_key(key_file)
        for rank in range(self.scenario.count):
            spec = WorkerSpec(scenario=str(scenario_copy.resolve()), steps=self.steps, rank=rank,
                              world=self.scenario.count, hosts=list(network.hosts),
                              run_dir=str(self.run_dir.resolve()), run_id=run_id,
                              run_store=network.control_address,
                              base_dir=str(self.scenario_path.resolve().parent),
                              key_file=str(key_file.resolve()) if key_file else None)
            self._spec_path(rank).write_text(spec.to_json())
        self._namespaces = [network.namespace(rank) for rank in range(self.scenario.count)]

    def _spec_path(self, rank: int) -> Path:
        return self.run_dir / "logs" / f"worker-{rank}.json"

    def _log_path(self, rank: int) -> Path:
        return self.run_dir / "logs" / f"worker-{rank}.log"

    def _failure(self, worker: WorkerState) -> str:
        """'worker N failed (exit 1): <its log's last line>', the reason where the log has one."""
        text = f"worker {worker.rank} {worker.status}"
        if worker.exit_code:
            text += f" (exit {worker.exit_code})"
        log = self._log_path(worker.rank)
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return f"{text}: {lines[-1]}" if lines else text

    def _probe_links(self, network: ClusterNetwork, writer: RunWriter) -> None:
        """`metrics.probe_links`: every directed link measured with a probe train before the
        workers start (`netem.probe`: loss and one-way delay), a `link` event each, which the
        report sets beside what was configured."""
        from netem.probe import probe

        for src in range(self.scenario.count):
            for dst in range(self.scenario.count):
                if src == dst:
                    continue
                self._check_interrupt()
                profile = network.links.effective(src, dst)
                result = probe(network.namespace(src), network.namespace(dst),
                               network.hosts[dst], count=LINK_PROBES)
                timed = math.isfinite(result.delay_mean)  # nothing came over a cut link
                writer.link(src, dst, profile.mean_loss, result.loss_ratio, probes=result.sent,
                            configured_delay_ms=profile.delay * 1e3,
                            measured_delay_ms=result.delay_mean * 1e3 if timed else None,
                            measured_jitter_ms=result.delay_stdev * 1e3 if timed else None)

    def _start(self, rank: int) -> None:
        """Start (or restart) worker `rank` from its spec file, in its namespace: forked by the
        zygote, which imported torch once for all of them."""
        assert self._zygote is not None
        process = self._zygote.spawn(rank, str(self._spec_path(rank).resolve()),
                                     self._namespaces[rank],
                                     str(self._log_path(rank).resolve()))
        with self._lock:
            self._processes[rank] = process
            self._killed.discard(rank)
            self._late.discard(rank)
            self.workers[rank].status = "starting"
            self.workers[rank].finished = self.workers[rank].lingering = False

    def _kill(self, ranks: list[int]) -> None:
        """Preemption: the worker is gone at once, without its own clean-up."""
        for rank in ranks:
            with self._lock:
                process = self._processes.get(rank)
                self._killed.add(rank)
            if process is not None and process.poll() is None:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            state = self.workers[rank]
            if state.command_pid is not None:  # a command job: its own process group too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(state.command_pid, signal.SIGKILL)
                state.command_pid = None
            state.status = "killed"

    def _restart(self, ranks: list[int]) -> None:
        """A preempted worker comes back and rejoins where the live ones are by then (unless
        the job is over: then it is done, with nothing to rejoin)."""
        for rank in ranks:
            self.workers[rank].restarts += 1
            with self._lock:
                over = self._job_over(rank)
                if over:
                    self._killed.discard(rank)
                    self._late.add(rank)
                    self.workers[rank].status = "done"
            if over:
                continue
            spec = WorkerSpec.from_json(self._spec_path(rank).read_text())
            self._spec_path(rank).write_text(dataclasses.replace(spec, rejoin=True).to_json())
            self._start(rank)

    def _burst(self, event: Event) -> None:
        """A straggler burst goes to each of its workers' control files (`BurstControl`)."""
        post_burst(self.run_dir, event)

    def _follow(self, timeline: Timeline, replay: LinkReplay, traffic: CrossTraffic,
                writer: RunWriter, on_update: Callable[[list[WorkerState]], None]) -> None:
        """Until every worker ended: apply their reports, start the timeline, the traced
        links' replay and the background flows once the workers are ready to train (time zero
        of their `at`s and `start`s), fire step
        events at the slowest worker's next step, and show the state."""
        fired = -1
        started = False
        while True:
            self._check_interrupt()
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise RunTimeout(f"the run took longer than {self._timeout:g} s")
            with contextlib.suppress(queue.Empty):
                rank, report = self._reports.get(timeout=POLL)
                self._apply(rank, report)
                while True:  # everything else already queued, before redrawing
                    rank, report = self._reports.get_nowait()
                    self._apply(rank, report)
            self._reap()
            running = [w for w in self.workers if w.status in ("starting", "running")]
            if not started and any(w.ready for w in self.workers):
                timeline.start(offset=writer.now())
                if replay:
                    replay.start()
                if traffic:
                    traffic.start()
                writer.event("training", workers=[w.rank for w in self.workers if w.ready])
                started = True
            if running and started:
                slowest = min(w.step for w in running) + 1
                while fired < slowest:
                    fired += 1
                    timeline.on_step(fired)
            on_update(self.workers)
            rejoining = [w for w in running if w.restarts and w.status == "starting"]
            training = [w for w in running if w not in rejoining and not w.finished]
            if rejoining and not training:  # the others ended: nothing left to rejoin
                self._release(rejoining, late=True)
            if running and all(w.lingering for w in running):
                self._release(running)  # every one is done: end their linger
            if not running and not self._reports.qsize() and not self._restart_due():
                return

    def _release(self, workers: list[WorkerState], *, late: bool = False) -> None:
        """SIGTERM to finished workers that linger (they exit 0), or (`late`) to restarted
        ones still setting up when the others have ended (done: the job is over for them);
        reaped by `_reap`."""
        with self._lock:
            if late:
                self._late |= {w.rank for w in workers}
            processes = [self._processes[w.rank] for w in workers if w.rank in self._processes]
        for process in processes:
            if process.poll() is None and process.pid not in self._released:
                self._released.add(process.pid)  # once: a second SIGTERM would cut its clean-up
                _signal_group(process, signal.SIGTERM)

    def _restart_due(self) -> bool:
        """A killed worker whose restart at a time is still to come keeps the run going even
        with no worker running (a restart at a step needs running workers to come)."""
        planned = Counter(worker for event in self.scenario.timeline
                          if event.action == "restart" and event.at is not None
                          for worker in event.restart or ())
        return any(planned[rank] > self.workers[rank].restarts for rank in self._killed)

    def _apply(self, rank: int, report: dict[str, Any]) -> None:
        state = self.workers[rank]
        if report.get("ready"):
            state.ready = True
            if isinstance(report.get("command_pid"), int):  # a command job: it runs now
                state.command_pid, state.started = report["command_pid"], time.monotonic()
                state.status = "running"
            return
        if report.get("done"):
            state.finished = True
            state.evaluation = dict(report.get("evaluation") or {})
            if isinstance(report.get("seconds"), int | float):
                state.seconds = float(report["seconds"])
            return
        if report.get("lingering"):
            state.lingering = True
            return
        if "step" not in report:
            return
        state.status = "running"
        state.step = int(report["step"])
        for name in ("loss", "step_seconds", "coverage"):
            value = report.get(name)
            if isinstance(value, int | float):
                setattr(state, name, float(value))
        lost = report.get("datagrams_lost")
        if isinstance(lost, int | float):
            state.datagrams_lost += float(lost)
        if report.get("drift") is not None:
            state.drift = float(report["drift"])

    def _reap(self) -> None:
        with self._lock:
            for rank, process in self._processes.items():
                code = process.poll()
                state = self.workers[rank]
                if code is None:
                    continue
                state.exit_code = code
                if rank in self._killed:
                    state.status = "killed"
                elif rank in self._late or (state.restarts and state.status == "starting"
                                            and self._job_over(rank)):
                    self._late.add(rank)  # back after the end: whatever it said, it is done
                    state.status = "done"
                else:
                    state.status = "done" if code == 0 else "failed"

    def _job_over(self, rank: int) -> bool:
        """Every worker but `rank` finished its training or is gone (killed, or restarted and
        still setting up): a worker coming back now has nothing left to rejoin, and the store
        it would rejoin by goes with the job's end."""
        others = [w for w in self.workers if w.rank != rank]
        return any(w.finished for w in others) and all(
            w.finished or w.rank in self._killed or (w.restarts and w.status == "starting")
            for w in others)

    def _stop_all(self) -> None:
        """SIGTERM to every worker still running, SIGKILL to what is left after the grace."""
        with self._lock:
            processes = list(self._processes.values())
        _stop(processes)
        self._reap()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised at a safe point; `signum` says which (a command exits with
    128 + signum: 130, 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _Interrupt:
    """Which signal asked the run to end, once one did."""

    signum: int | None = None


@contextlib.contextmanager
def _interrupts_at_safe_points() -> Iterator[_Interrupt]:
    """Ctrl-C or SIGTERM (a `kill`, a CI job's timeout) records itself instead of raising
    wherever the main thread is: a KeyboardInterrupt between a lock's acquire and its `with`
    block (in the live display, a queue, a network change) leaves the lock held, and the
    clean-up that follows waits on it forever. The run checks between its steps; a second
    signal raises at once. Off the main thread (where signals cannot be handled) nothing is
    ever recorded."""
    interrupted = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_signal(signum: int, frame: Any) -> None:
        if interrupted.signum is not None:
            raise Interrupted(signum)
        interrupted.signum = signum

    previous = {signum: signal.signal(signum, on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop(processes: Sequence[ForkedWorker]) -> None:
    """SIGTERM to each process still running, SIGKILL to what is left after the grace."""
    for process in processes:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: ForkedWorker, signum: int) -> None:
    """The worker's whole process group (a child that has not made its own yet: itself)."""
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            os.kill(process.pid, signum)


def render(run_dir: Path) -> Path | None:
    """The run's plots and page; a report that cannot be drawn does not fail the run."""
    from testbed.report.page import render_run

    try:
        return render_run(run_dir).html
    except Exception as exc:
        print(f"report: not rendered: {exc}", file=sys.stderr)
        return None


def safe_name(text: str) -> str:
    """A scenario's name as a directory name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"
