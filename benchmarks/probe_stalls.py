"""How often the probe's busy-host rule fires in the UML guest, idle and under load: timed
trains over netem links of 10 and 40 ms, each judged with the rule that leaves out the probes
merely in flight across a stall of the sender (before) and with the one that leaves out the
probes a stall held up (`netem.probe.analysis.held_by_stalls`, now).

`python -m benchmarks.probe_stalls` boots a guest and runs the trains there, once with the host
idle and once with `--busy` busy loops on the host (the soak's load), and writes
benchmarks/results/probe-stalls.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np

from benchmarks.machine import in_guest
from benchmarks.report import Run
from netem.probe.analysis import MIN_TIMED

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "probe-stalls.md"
DELAYS_MS = (10, 40)
COUNT = 2000  # probes a train, as the fidelity tier's wrong-delay test sends
OLD_MAX_STALLED = 0.2  # the rule before: judge only with at most a fifth in flight in a stall


@dataclasses.dataclass(frozen=True)
class TrainFigures:
    """One train: its arrivals, the sender's stalls, and both rules' verdicts."""

    delay_ms: int
    arrivals: int
    stalls: int
    stalled_ms: float  # the stalls' total length
    in_flight: int  # arrivals in flight across a stall (left out before)
    held: int  # arrivals a stall held up (left out now)
    mean_in_flight_ms: float  # delay mean of the rest, before
    mean_held_ms: float  # delay mean of the rest, now
    judged_before: bool
    judged_now: bool


def in_flight(windows: np.ndarray, sent_ns: np.ndarray, recv_ns: np.ndarray) -> np.ndarray:
    """The rule before: arrivals sent before a stall ended and received after it began."""
    if not len(windows):
        return np.zeros(sent_ns.shape, dtype=bool)
    windows = windows[np.argsort(windows[:, 0])]
    first = np.searchsorted(windows[:, 1], sent_ns, side="right")
    inside = first < len(windows)
    hit = np.zeros(sent_ns.shape, dtype=bool)
    hit[inside] = windows[first[inside], 0] < recv_ns[inside]
    return hit


def trains(count_each: int) -> list[TrainFigures]:
    """Inside the guest: `count_each` trains per delay, each on a fresh lab."""
    from netem import LinkProfile, apply
    from netem.lab import Lab
    from netem.probe.analysis import held_by_stalls
    from netem.probe.engine import run_train

    figures = []
    for delay in DELAYS_MS:
        with Lab(2) as lab:
            apply(lab.hosts[1].switch_port, LinkProfile.parse(delay=f"{delay}ms"),
                  netns=lab.switch)
            source, target = lab.hosts
            for _ in range(count_each):
                train = run_train(source.netns, target.netns, target.address, count=COUNT,
                                  interval=0.0004, size=128, timeout=5.0)
                sent, recv = train.sent_ns, train.recv_ns
                delays = (recv - sent) / 1e6
                before = in_flight(train.stalls, sent, recv)
                now = held_by_stalls(train.stalls, sent, recv)
                arrivals = int(sent.size)
                figures.append(TrainFigures(
                    delay_ms=delay, arrivals=arrivals, stalls=len(train.stalls),
                    stalled_ms=float((train.stalls[:, 1] - train.stalls[:, 0]).sum() / 1e6),
                    in_flight=int(before.sum()), held=int(now.sum()),
                    mean_in_flight_ms=float(delays[~before].mean()) if (~before).any()
                    else float("nan"),
                    mean_held_ms=float(delays[~now].mean()) if (~now).any() else float("nan"),
                    judged_before=bool(before.sum() <= OLD_MAX_STALLED * max(arrivals, 1)),
                    judged_now=bool(arrivals - now.sum() >= min(MIN_TIMED, arrivals / 2))))
                print(f"delay {delay} ms: {figures[-1]}", file=sys.stderr, flush=True)
    return figures


def _busy() -> None:
    while True:
        pass


def trains_in_guest(count_each: int, busy: int) -> list[TrainFigures]:
    """Boot a guest for the trains, with `busy` busy loops on the host meanwhile."""
    loops = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(busy)]
    for loop in loops:
        loop.start()
    try:
        items, _ = in_guest("benchmarks.probe_stalls", "--trains", str(count_each))
        return [TrainFigures(**item) for item in items]
    finally:
        for loop in loops:
            loop.terminate()


def report(runs: dict[str, list[TrainFigures]], run: Run) -> str:
    rows = []
    for load, figures in runs.items():
        for delay in DELAYS_MS:
            mine = [f for f in figures if f.delay_ms == delay]
            arrivals = sum(f.arrivals for f in mine)
            rows.append(
                f"| {load} | {delay} ms | {len(mine)} | "
                f"{np.mean([f.stalls for f in mine]):.1f} | "
                f"{np.mean([f.stalled_ms for f in mine]):.1f} ms | "
                f"{sum(f.in_flight for f in mine) / arrivals:.1%} | "
                f"{sum(f.held for f in mine) / arrivals:.1%} | "
                f"{sum(not f.judged_before for f in mine)} of {len(mine)} | "
                f"{sum(not f.judged_now for f in mine)} of {len(mine)} | "
                f"{np.nanmean([f.mean_in_flight_ms for f in mine]):.3f} ms | "
                f"{np.nanmean([f.mean_held_ms for f in mine]):.3f} ms |")
    return "\n".join([
        *run.header("The probe's busy-host rule in the UML guest"),
        f"Timed trains of {COUNT} probes (128 bytes, every 400 us) over a netem delay in the",
        "guest, each on a fresh two-host lab; `idle`: no busy loop of the benchmark's own on",
        "the host; `loaded`: busy loops on the host meanwhile. A stall is a wake-up of the",
        "sender, or a send call's return, more than 1 ms late. `in flight` (the rule before)",
        "leaves out every",
        "arrival in flight across a stall and judges a train only if that is at most a fifth",
        "of them; `held up` (now) leaves out the arrivals stamped from 1 ms before a stall to",
        "its end or received during it or within 1 ms after it, and judges a train on the",
        f"rest if at least {MIN_TIMED} (or half the arrivals) are left. `not judged`: trains whose",
        "delay each rule would not judge. The delay means are of the probes each rule keeps.",
        "",
        "| host | delay | trains | stalls a train | stalled a train | in flight | held up | "
        "not judged before | not judged now | delay mean before | delay mean now |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe_stalls",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trains", type=int, default=10, help="trains per delay and load")
    parser.add_argument("--busy", type=int, default=1, help="busy loops on the host, loaded")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--guest-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.guest_json:  # inside the guest: the trains, as JSON for the host
        figures = trains(args.trains)
        args.guest_json.write_text(json.dumps([dataclasses.asdict(f) for f in figures]))
        return
    run = Run.start("benchmarks.probe_stalls")
    runs = {"idle": trains_in_guest(args.trains, 0),
            f"loaded ({args.busy} busy)": trains_in_guest(args.trains, args.busy)}
    args.output.write_text(report(runs, run))
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
