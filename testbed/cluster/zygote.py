"""Worker processes forked from one that has imported torch already.

A fresh interpreter spends seconds of CPU importing torch (3.3 s here, 14 s in the UML guest), so
16 workers started as 16 interpreters need a minute of CPU on 2 cores before the first step. The
runner instead starts one zygote (`python -m testbed.cluster.zygote`) that imports what a
worker needs and, for each request on its stdin, forks a child that enters the worker's network
namespace (setns), starts a session of its own (so its process group can be signalled as one),
sends its stderr to the worker's log and runs `testbed.cluster.worker.run_worker(SPEC)`. The
zygote reports on its stdout, one JSON line each, `{"started": rank, "pid": ...}` and
`{"exited": rank, "code": ...}` (a negative code: killed by that signal); the workers' own
JSON lines share that stdout (each is one write, and carries its rank). The zygote runs no
torch operation and starts no thread, so a fork copies a quiet process.

It forks the run's store too (`serve_store`): a torch TCPStore needs torch, and the runner,
which imports none, would otherwise pay a second import of it (10 s of the guest's one CPU).
The store's child serves until the run stops it, or the zygote's stdin ends (the runner gone):
the zygote then sends it SIGTERM.

`Zygote` is the runner's end: `spawn(rank, spec, netns, log) -> ForkedWorker`, whose `poll`,
`wait` and `pid` stand in for a `subprocess.Popen`'s. A process that runs one run after another
(a test suite, a sweep) keeps the zygote of a run that ended with nothing left running, and the
next run takes it (`acquire`, `release`): its imports are paid once per process, not per run
(18 s each in the guest). Only a process with the same environment and directory takes it:
what the workers inherit stays what the run's process has.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from testbed.cluster.worker import say

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
STORE = "store"  # the key of the store's child, where workers have their rank
# torch._dynamo: every torch.optim optimizer imports it when it is made (~800 modules: seconds
# of CPU, in every worker if the zygote did not).
PRELOAD = ("torch", "torch._dynamo", "testbed.cluster.exchange", "testbed.cluster.worker",
           "testbed.collectives", "testbed.metrics.drift", "testbed.metrics.worker",
           "testbed.report", "testbed.scenario", "testbed.train")
REAP_EVERY = 0.05  # seconds between the zygote's looks for exited children
IDLE_KEPT = 2  # zygotes kept between runs, at most, per process


class ForkedWorker:
    """A worker forked by the zygote: its pid and, once the zygote saw it end, its exit code."""

    def __init__(self, rank: int | str) -> None:
        self.rank = rank
        self.pid = 0
        self.returncode: int | None = None
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.rank}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


# Variables that change under a process without changing what its workers need: pytest names
# the test running in PYTEST_CURRENT_TEST, and a suite's runs would otherwise never share.
NOT_INHERITED = frozenset({"PYTEST_CURRENT_TEST"})


def _inherited() -> tuple[Any, ...]:
    """What a zygote's workers inherit from the process that started it."""
    return sys.executable, os.getcwd(), tuple(sorted(
        (name, value) for name, value in os.environ.items() if name not in NOT_INHERITED))


_idle: list[Zygote] = []
_idle_lock = threading.Lock()


def acquire(on_line: Callable[[int, dict[str, Any]], None], log: str) -> Zygote:
    """A zygote for one run, its own stderr appended to `log`: one a run of this process left
    idle, with what its workers inherit unchanged, or a new one."""
    inherited = _inherited()
    with _idle_lock:
        kept = [z for z in _idle if z.inherited == inherited and z.alive()]
        stale = [z for z in _idle if z not in kept]
        _idle[:] = kept[1:]
    for zygote in stale:
        zygote.close()
    zygote = kept[0] if kept else Zygote(inherited, log)
    zygote.begin(on_line, log)
    return zygote


def release(zygote: Zygote) -> None:
    """The run is over: keep its zygote for the next run when nothing it forked still runs,
    else end it."""
    if zygote.alive() and zygote.idle():
        with _idle_lock:
            if len(_idle) < IDLE_KEPT:
                _idle.append(zygote)
                return
    zygote.close()


@atexit.register
def close_idle() -> None:
    """End the zygotes kept idle: they are reaped, and with them the CPU time of every worker
    they forked reaches this process's RUSAGE_CHILDREN (a benchmark's per-run figure)."""
    with _idle_lock:
        idle, _idle[:] = list(_idle), []
    for zygote in idle:
        zygote.close()


class Zygote:
    """The runner's end of the zygote. Each run `begin`s with its `on_line(rank, report)`,
    which gets every JSON line a worker prints; started and exited workers update their
    `ForkedWorker`."""

    def __init__(self, inherited: tuple[Any, ...], log: str, *,
                 start_timeout: float = 300.0) -> None:
        self.inherited = inherited
        self.on_line: Callable[[int, dict[str, Any]], None] = lambda rank, report: None
        self.start_timeout = start_timeout
        self._workers: dict[int | str, ForkedWorker] = {}  # the latest of each rank
        self._lock = threading.Lock()
        with open(log, "a") as stderr:  # until a run hands it another log
            self._process = subprocess.Popen(
                [sys.executable, "-m", "testbed.cluster.zygote"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def begin(self, on_line: Callable[[int, dict[str, Any]], None], log: str) -> None:
        """A run takes this zygote: its lines go to `on_line`, the zygote's stderr to `log`."""
        with self._lock:
            self._workers = {}
        self.on_line = on_line
        self._send({"stderr": log})

    def alive(self) -> bool:
        return self._process.poll() is None

    def idle(self) -> bool:
        """Whether everything it forked has ended (and been reported)."""
        with self._lock:
            return all(child.returncode is not None for child in self._workers.values())

    def spawn(self, rank: int, spec: str, netns: str, log: str) -> ForkedWorker:
        """Fork worker `rank` running `spec` in namespace `netns`, stderr appended to `log`;
        returns once it is forked (the zygote's imports come first, once)."""
        return self._fork(rank, {"rank": rank, "spec": spec, "netns": netns, "log": log})

    def serve_store(self, host: str, port: int, netns: str, log: str) -> ForkedWorker:
        """Fork the child that serves the run's store on `host`:`port` in namespace `netns`
        until the run stops it (or this zygote's end); its stderr appended to `log`. Clients that
        connect before it listens retry until it does."""
        return self._fork(STORE, {"store": [host, port], "netns": netns, "log": log})

    def _send(self, request: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()

    def _fork(self, key: int | str, request: dict[str, Any]) -> ForkedWorker:
        child = ForkedWorker(key)
        with self._lock:
            self._workers[key] = child
        self._send(request)
        name = "the store" if key == STORE else f"worker {key}"
        if not child._started.wait(self.start_timeout):
            raise RuntimeError(f"the zygote did not fork {name} within "
                               f"{self.start_timeout:g} s (exit {self._process.poll()})")
        if child.pid < 0:
            raise RuntimeError(f"the zygote could not fork {name}")
        return child

    def close(self) -> None:
        """End the zygote (its stdin closes; it forks no more, and ends the store). Workers
        are the caller's."""
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(10)

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if not isinstance(report, dict):
                continue
            if "started" in report or "exited" in report:
                self._lifecycle(report)
            elif isinstance(report.get("rank"), int):
                self.on_line(report["rank"], report)
        with self._lock:  # the zygote is gone: whoever it did not report on is lost
            orphans = [w for w in self._workers.values() if w.returncode is None]
        for worker in orphans:
            worker.pid = worker.pid or -1
            worker._started.set()

    def _lifecycle(self, report: dict[str, Any]) -> None:
        with self._lock:
            worker = self._workers.get(report.get("started", report.get("exited")))
        if worker is None:
            return
        if "started" in report:
            worker.pid = int(report["pid"])
            worker._started.set()
        elif worker.pid == report.get("pid"):
            worker.returncode = int(report["code"])
            worker._ended.set()


# -- the zygote process -------------------------------------------------------------------------


def _enter(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


def _append_stderr_to(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)


def _child(request: dict[str, Any]) -> int:
    """In the forked child: a session of its own (its group is signalled as one), stderr to
    its log, no stdin, in its namespace; then become worker `request['rank']`, or serve the
    run's store."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _append_stderr_to(request["log"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _enter(request["netns"])
    if "store" in request:
        return _serve_store(*request["store"])
    from testbed.cluster import worker

    return worker.run_worker(request["spec"])


def _serve_store(host: str, port: int) -> int:
    """Serve the run's store until SIGTERM (from the zygote), or the zygote's death."""
    from testbed.cluster.exchange import serve_run_store

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    served = [serve_run_store(host, port)]  # listens for as long as it is referenced
    while served:
        signal.pause()
    return 0


def main() -> NoReturn:
    # The collector off while importing: torch's imports make hundreds of thousands of objects
    # that all live on, and the collections they trigger only scan them (about a sixth of the
    # imports' CPU). Frozen after, so no collection in the zygote or a worker scans them again
    # (nor writes to their pages, which the forks share).
    gc.disable()
    for name in PRELOAD:  # the point of the zygote: imported once, shared by every fork
        importlib.import_module(name)
    gc.freeze()
    gc.enable()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle
    children: dict[int, int | str] = {}  # pid -> rank, or STORE
    pending = b""
    reading = True
    while reading or children:
        if reading and select.select([0], [], [], REAP_EVERY)[0]:
            data = os.read(0, 1 << 16)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in filter(None, (raw.strip() for raw in lines)):
                request = json.loads(line)
                if "stderr" in request:  # a run takes this zygote: its log from now on
                    _append_stderr_to(request["stderr"])
                    continue
                key = STORE if "store" in request else request["rank"]
                pid = _fork(request)
                children[pid] = key
                say(started=key, pid=pid)
            if not data:  # EOF: the runner is done (or gone): end the store, reap the rest
                reading = False
                for pid in [pid for pid, key in children.items() if key == STORE]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        elif not reading:
            select.select([], [], [], REAP_EVERY)
        _reap(children)
    sys.stdout.flush()
    # Out without the interpreter's clean-up: tearing down torch's thousands of modules took
    # 4.8 s of the guest's one CPU at the end of every run, and there is nothing to clean.
    os._exit(0)


def _fork(request: dict[str, Any]) -> int:
    """Fork the child that becomes the worker; returns its pid (in the zygote)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _child(request)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, int | str]) -> None:
    """Report every child that ended, with its exit code."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rank = children.pop(pid, None)
        if rank is not None:
            say(exited=rank, pid=pid, code=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
