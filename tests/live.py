"""Helpers for tests that watch something live from outside: an instant PromQL query through
the port a Compose project or a stack publishes; `wait_for`, the bounded poll that names what it
last saw, and what it polls (whether a process ended; a condition that fails at once when its
process ended first, or that reads datagram endpoints meanwhile); a `testbed run` in a process
of its own, for the tests that signal or kill it; what worker processes hand back through a
queue."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any, TypeVar

from netem.lab import lab_namespaces
from testbed.compose import PROMETHEUS_PORT

T = TypeVar("T")


def promql(expr: str) -> dict[str, float]:
    """An instant PromQL query: {labels as 'k=v,...' (without instance and job): value}."""
    url = (f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?"
           + urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {",".join(f"{k}={v}" for k, v in sorted(item["metric"].items())
                     if k not in ("__name__", "instance", "job")): float(item["value"][1])
            for item in body["data"]["result"]}


def wait_for(what: str, read: Callable[[], T], ready: Callable[[T], bool], timeout: float, *,
             every: float = 1.0, log: Callable[[], str] | None = None) -> T:
    """`read()` every `every` seconds until `ready` says its value will do; fails naming what
    it waited for, the last value read and, with `log`, what that says then (a process's log).

    Containers, tasks, scrapes, processes and files offer nothing to wait on but polling. An
    assertion in `read` (a process that ended early) fails at once."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = read()
        except OSError as error:  # Prometheus not listening yet
            last = error
        else:
            if ready(value):
                return value
            last = value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})"
                         + (f"\n{log()}" if log else ""))


def ended(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (its reaper may be slow)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def unless_ended(condition: Callable[[], bool], process: subprocess.Popen[Any],
                 why: Callable[[], str]) -> Callable[[], bool]:
    """`condition` as a `wait_for` read that fails at once where `process` ended before it
    held (`why()` says why: its log, say) instead of waiting out the timeout."""

    def read() -> bool:
        if condition():
            return True
        assert process.poll() is None, why()
        return False

    return read


def start_run(scenario: Path, out: Path, what: str, ready: Callable[[], bool], *options: str,
              timeout: float = 120.0) -> tuple[subprocess.Popen[bytes], set[str]]:
    """`testbed run SCENARIO -o OUT OPTIONS` in a process of its own, returned once `ready()` holds
    (named `what` if it never does): the process, and the namespaces the run made (by the
    prefix it recorded: other tests' labs may come and go meanwhile). Its stderr goes to
    OUT.stderr; the process is killed if it ends or fails to get ready."""
    stderr = out.with_suffix(".stderr")
    runner = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", str(scenario),
                               "--sandbox", "none", "-o", str(out), *options],
                              stdout=subprocess.DEVNULL, stderr=stderr.open("w"))
    try:
        wait_for(what, unless_ended(ready, runner, lambda: stderr.read_text()[-3000:]), bool,
                 timeout, every=0.2)
        cluster = next(json.loads(line) for line in (out / "events.jsonl").read_text()
                       .splitlines() if '"cluster"' in line)
        return runner, set(lab_namespaces(cluster["prefix"]))
    except BaseException:
        runner.kill()
        runner.wait()
        raise


def reading(condition: Callable[[], bool], *endpoints: Any) -> Callable[[], bool]:
    """`condition` as a `wait_for` read that reads every endpoint's socket (`poll`) while it
    does not hold: what it waits for arrives only as they read."""

    def read() -> bool:
        if condition():
            return True
        for endpoint in endpoints:
            endpoint.poll(0.01)
        return False

    return read


def collect(results: Queue, processes: Sequence[BaseProcess], timeout: float) -> list[Any]:
    """One item from `results` per process, as they come, within `timeout`; a process that
    exits with an error fails the test at once (its traceback is above), not after the wait."""
    collected: list[Any] = []

    def gathered() -> int:
        try:
            collected.append(results.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            assert not dead, f"a worker exited with {dead[0]} (its traceback is above)"
        return len(collected)

    wait_for("a result from every worker", gathered, lambda count: count == len(processes),
             timeout, every=0)
    return collected
