"""One rank of a cell, a process in its own namespace: builds its input and the collective,
then makes one all-reduce per "go" line on stdin and reports each as a JSON line.

    python -m benchmarks.collectives.worker SPEC   (SPEC: JSON, written by the runner)
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import machine
from benchmarks.collectives.cells import SETUP_NUMEL
from benchmarks.collectives.inputs import compare, make_input
from testbed.transport.counters import namespace_counters

# This namespace's TCP counters, per call: what the queues cost (retransmissions after a
# drop, retransmission timeouts, tail loss probes) beside the segments sent.
NETWORK_COUNTERS = {"tcp_out_segs": "netns_sent_segments",
                    "tcp_retrans_segs": "netns_retransmitted_segments",
                    "tcpext_tcp_timeouts": "netns_timeouts",
                    "tcpext_tcp_loss_probes": "netns_loss_probes"}


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
            counted = namespace_counters()
            started = time.monotonic()
            result, stats = collective.allreduce(tensor, call)
            seconds = time.monotonic() - started
            now = namespace_counters()
            extra = {key: value for key, value in stats.extra.items()
                     if key in ("tcp_retransmits", "datagrams_lost", "rcvbuf_drops",
                                "chunks_missing", "datagrams_late", "deadline_seconds",
                                "broadcast_deadline_seconds", "rounds_incomplete",
                                "gather_seconds", "broadcast_seconds")}
            extra |= {name: float(now.get(key, 0) - counted.get(key, 0))
                      for key, name in NETWORK_COUNTERS.items()}
            say(event="call", call=call, started=started, seconds=seconds,
                coverage=stats.coverage,
                bytes_sent=stats.bytes_sent, peers_missing=list(stats.peers_missing),
                rounds=[[r.seconds, r.roll_call_seconds, r.scatter_seconds]
                        for r in getattr(stats, "rounds", ())], extra=extra)
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


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
