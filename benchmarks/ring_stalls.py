"""How long the reliable ring's all-reduce stalls under random loss: the tail that TCP's
retransmission timeout gives it, which decides what a ring's `timeout` must allow.

A lab of four hosts (namespaces on a bridge), every host's downlink losing the given share of
packets (`netem.apply(..., backend="fallback")`: nftables random drop, so data and
acknowledgements alike), the testbed's `Ring` on each host over TCP cubic, many all-reduces of
the MLP's size one after another. A call ends when the slowest stream has delivered, and a
segment lost again doubles its retransmission timeout (and TCP's timestamps count a mended
loss as round-trip time), so the calls' times have a long tail; sampled from every rank's
sending socket (TCP_INFO) every 50 ms: the retransmission timeout.

    .venv/bin/python -m benchmarks.ring_stalls [--losses 3,10,20] [--calls 300] [--numel 4810]
        [--timeout 120] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.report import Run

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "ring-stalls.md"
WORLD = 4
NUMEL = 4810  # the MLP's parameters (the netns tier's ring tests train it)
TIMEOUT = 120.0  # seconds a send or receive may take by default: what the netns tier's rings allow
SAMPLE_EVERY = 0.05  # seconds between TCP_INFO samples
THRESHOLDS = (1.0, 5.0, 30.0)  # seconds: how many calls took longer


@dataclass(frozen=True)
class Outcome:
    loss: float  # percent
    seconds: list[float]  # each call's, the slowest rank's, up to the first that timed out
    broken: str  # what ended the calls early (a send or receive past the timeout), if any
    retransmits: int
    rto_ms: list[float]  # the samples


def measure(loss: float, calls: int, numel: int, timeout: float) -> Outcome:
    """Up to `calls` all-reduces of `numel` floats on a fresh lab with `loss`% on every
    downlink, until one times out (the ring is broken then)."""
    import torch

    from netem import apply
    from netem.lab import Lab
    from netem.namespace import inside
    from netem.profile import LinkProfile
    from testbed.collectives.ring import Ring
    from testbed.transport import Listener, TransportError

    with Lab(WORLD) as lab:
        profile = LinkProfile.parse({"loss": f"{loss}%"})
        for host in lab.hosts:
            apply(host.switch_port, profile, netns=lab.switch, backend="fallback")
        listeners = []
        for host in lab.hosts:
            with inside(host.netns):
                listeners.append(Listener((host.address, 0), congestion="cubic"))
        addresses = [listener.address for listener in listeners]
        rings: list[Ring] = []
        lock = threading.Lock()

        def join(rank: int) -> None:  # connecting from the rank's own namespace
            with inside(lab.hosts[rank].netns):
                ring = Ring(rank, WORLD, addresses=addresses, listener=listeners[rank],
                            timeout=timeout)
            with lock:
                rings.append(ring)

        _together(join)
        rings.sort(key=lambda ring: ring.rank)
        times = np.zeros((WORLD, calls))
        ended = np.full(WORLD, calls)  # the calls each rank completed
        broken: list[str] = []

        def work(rank: int) -> None:
            tensor = torch.ones(numel)
            for call in range(calls):
                started = time.monotonic()
                try:
                    rings[rank].allreduce(tensor, call)
                except (TransportError, OSError) as error:
                    ended[rank] = call
                    with lock:  # the first one breaks the ring: the others stop at once
                        if not broken:
                            broken.append(f"call {call}: {error}")
                            for ring in rings:
                                ring.mesh.close()
                    return
                times[rank, call] = time.monotonic() - started

        done = threading.Event()
        rto_ms: list[float] = []

        def sample() -> None:
            while not done.wait(SAMPLE_EVERY) and not broken:
                try:
                    rto_ms.extend(ring.mesh[ring.right].tcp_info().rto / 1000
                                  for ring in rings)
                except OSError:  # closed as the ring broke
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            _together(work)
        finally:
            done.set()
            sampler.join()
        retransmits = sum(c.tcp_retransmits for ring in rings
                          for c in ring.mesh.counters().values())
        for ring in rings:
            ring.close()
    done_calls = int(ended.min())
    return Outcome(loss, times[:, :done_calls].max(axis=0).tolist(),
                   broken[0] if broken else "", retransmits, rto_ms)


def _together(task) -> None:
    """`task(rank)` for every rank at once, each on a thread; the first error raised here."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            task(rank)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def report(outcomes: list[Outcome], run: Run, numel: int, timeout: float) -> str:
    rows = []
    for o in outcomes:
        seconds = np.array(o.seconds or [math.nan])
        over = " | ".join(str(int((seconds > t).sum())) for t in THRESHOLDS)
        rto = np.array(o.rto_ms or [math.nan])
        rows.append(f"| {o.loss:g}% | {len(o.seconds)} | {o.broken or 'no'} | "
                    f"{seconds.mean():.3f} | {np.median(seconds):.3f} | "
                    f"{np.percentile(seconds, 99):.2f} | {seconds.max():.2f} | {over} | "
                    f"{o.retransmits} | {np.median(rto):.0f} | {rto.max():.0f} |")
    over_heads = " | ".join(f"calls over {t:g} s" for t in THRESHOLDS)
    return "\n".join([
        *run.header("How long the reliable ring stalls under random loss"),
        f"How: a lab of {WORLD} hosts (namespaces on a bridge), every host's downlink losing "
        "the share in the table (`netem.apply(..., backend=\"fallback\")`: nftables random "
        "drop, data and acknowledgements alike), the testbed's `Ring` on each host over TCP "
        f"cubic, all-reduces of {numel} floats one after another, each send and receive "
        f"allowed {timeout:g} s (the ring's `timeout`). `calls` are those that completed: a "
        "send or receive past the timeout breaks the ring and ends that loss's calls (`broke "
        "at`). A call's seconds are its slowest rank's. `RTO` is the retransmission timeout "
        "of every rank's sending socket (TCP_INFO), sampled every "
        f"{SAMPLE_EVERY * 1000:.0f} ms during the calls; `retransmits` the segments TCP sent "
        "again, all ranks.",
        "",
        f"| loss | calls | broke at | mean s | median s | p99 s | max s | {over_heads} | "
        "retransmits | RTO median ms | RTO max ms |",
        "|---:|---:|---|---:|---:|---:|---:|" + "---:|" * len(THRESHOLDS) + "---:|---:|---:|",
        *rows,
        "",
        "A ring's call ends when its slowest stream has delivered, and a segment lost again "
        "(or its acknowledgement) doubles that stream's retransmission timeout, so the calls' "
        "times have a long tail that grows fast with the loss: a ring's `timeout` "
        "(default 30 s) must allow the tail of the loss it runs under.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ring_stalls",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--losses", default="3,10,20",
                        help="comma-separated loss percentages (default 3,10,20)")
    parser.add_argument("--calls", type=int, default=300, help="all-reduces per loss")
    parser.add_argument("--numel", type=int, default=NUMEL, help="floats per all-reduce")
    parser.add_argument("--timeout", type=float, default=TIMEOUT,
                        help=f"the ring's timeout, seconds (default {TIMEOUT:g})")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        losses = [float(x) for x in args.losses.split(",") if x]
    except ValueError:
        parser.error(f"--losses: expected comma-separated percentages, got {args.losses!r}")
    if not losses or any(not 0 <= x < 100 for x in losses):
        parser.error(f"--losses: expected percentages in [0, 100), got {args.losses!r}")
    if args.calls < 1 or args.numel < WORLD or args.timeout <= 0:
        parser.error(f"--calls: expected at least 1; --numel: at least {WORLD}; "
                     "--timeout: above 0")
    run = Run.start("benchmarks.ring_stalls")
    outcomes = []
    for loss in losses:
        outcomes.append(measure(loss, args.calls, args.numel, args.timeout))
        print(f"{loss:g}%: {len(outcomes[-1].seconds)} calls, "
              f"broke: {outcomes[-1].broken or 'no'}, {run.elapsed() / 60:.1f} min",
              file=sys.stderr)
        args.out.write_text(report(outcomes, run, args.numel, args.timeout))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
