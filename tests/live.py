"""Helpers for tests that watch a live run from outside: an instant PromQL query through the
port a Compose project or a stack publishes, and a bounded poll that names what it last saw."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TypeVar

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


def wait_for(what: str, read: Callable[[], T], ready: Callable[[T], bool], timeout: float) -> T:
    """`read()` until `ready` says its value will do; fails naming the last value read.

    Containers, tasks and scrapes offer nothing to wait on but polling, once a second."""
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
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})")
