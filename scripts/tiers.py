#!/usr/bin/env python3
"""Run the test tiers (`make test`) in three lanes side by side: the guest tier in its
User-Mode Linux guest; the compose tier, then the netns tier; the unit tier once the compose
tier has ended.

The guest has one CPU (UML is not SMP) and keeps one core busy for its whole tier; the other
tiers run niced on what is left, so the guest's timed checks see the CPU they would see alone.
The compose tier mostly waits (for its engine, containers and guest), so it loses little beside
the guest, but the unit tests beside it stretched it by minutes (CPU its guest and containers
wanted): they wait for its end and run beside the netns tier, which keeps about one core busy
(a busy core beside it is what `make soak` gives it). The netns tier comes after the compose
tier, never beside it: the Docker Engine the compose tier starts sets the host's FORWARD policy
to DROP and loads br_netfilter, which would drop what the namespaces' bridges carry. `--serial`
runs the tiers one after another instead.

Standard library only: it runs before and beside the project's own venv."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VENV", ROOT / ".venv"))
_PYTEST = [str(VENV / "bin/python"), "-m", "pytest"]
TIERS = {
    "unit": [*_PYTEST, "-m", "not netns and not netem_kernel and not compose and not gpu",
             "tests"],
    "netns": [*_PYTEST, "-m", "netns and not netem_kernel and not compose and not gpu", "tests"],
    "compose": [*_PYTEST, "-m", "compose", "tests"],
    "guest": [str(VENV / "bin/testbed"), "sandbox", "pytest", "-m", "netem_kernel", "tests"],
}
# Tiers in one lane run one after another, the lanes side by side; the first lane's output is
# shown as it runs, the others' when they end.
LANES = (("compose", "netns"), ("guest",), ("unit",))
AFTER = {"unit": "compose"}  # a tier that starts once that one (if it is run) has ended
UNNICED = "guest"  # the tier whose one CPU goes first
NICE = 10  # the other tiers' niceness, beside it
# How a tier is stopped early: pytest unwinds on SIGINT as on Ctrl-C (its fixtures' teardown
# removes namespaces and stops the engine); the sandbox turns SIGTERM into a clean exit (the
# guest powered off, its directory removed).
STOP = {"guest": signal.SIGTERM}


class Lanes:
    """The tiers' processes, so that a stop (Ctrl-C, a CI job's SIGTERM) ends every one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._stopped = False
        self.exits: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.ended = {tier: threading.Event() for tier in TIERS}

    def run(self, tier: str, command: list[str], sink: int | None) -> None:
        """Run one tier to its end in its own process group, recording its exit and time."""
        begun = time.monotonic()
        with self._lock:
            if self._stopped:
                return
            process = subprocess.Popen(command, cwd=ROOT, stdout=sink,
                                       stderr=None if sink is None else subprocess.STDOUT,
                                       start_new_session=True)
            self._running.append((tier, process))
        self.exits[tier] = process.wait()
        self.seconds[tier] = time.monotonic() - begun
        self.ended[tier].set()

    def stop(self) -> None:
        """Stop every running tier's process group (`STOP`), then wait for their exits."""
        with self._lock:
            self._stopped = True
            running = list(self._running)
        for ended in self.ended.values():  # a tier waiting for another starts nothing
            ended.set()
        for tier, process in running:
            if process.poll() is None:
                os.killpg(process.pid, STOP.get(tier, signal.SIGINT))
        for _, process in running:
            process.wait()


def plan(tiers: list[str], serial: bool) -> list[list[str]]:
    """The lanes to run, each the chosen tiers of one of LANES (in LANES' order); serially,
    one lane of the tiers in the order given."""
    if serial:
        return [tiers]
    return [lane for lane in ([t for t in group if t in tiers] for group in LANES) if lane]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(TIERS),
                        help="comma-separated, of: " + ", ".join(TIERS) + " (default all)")
    parser.add_argument("--serial", action="store_true",
                        help="one tier after another, in the order given, none niced")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "tiers",
                        help="where the logs of the tiers beside the first lane go "
                             "(default build/tiers)")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        parser.error(f"--tiers: unknown {unknown or 'none given'}; allowed: {', '.join(TIERS)}")

    # A CI job's timeout (SIGTERM) unwinds as Ctrl-C does: no guest is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    lanes = plan(tiers, args.serial)
    side_by_side = len(lanes) > 1
    started = time.monotonic()
    state = Lanes()

    def command(tier: str) -> list[str]:
        niced = side_by_side and tier != UNNICED
        return [*(["nice", "-n", str(NICE)] if niced else []), *TIERS[tier]]

    def run_beside(lane: list[str]) -> None:
        for tier in lane:
            if AFTER.get(tier) in tiers:
                state.ended[AFTER[tier]].wait()
            with (args.out / f"{tier}.log").open("wb") as sink:
                state.run(tier, command(tier), sink.fileno())

    threads = [threading.Thread(target=run_beside, args=(lane,), daemon=True)
               for lane in lanes[1:]]
    try:
        if threads:
            args.out.mkdir(parents=True, exist_ok=True)
            beside = [tier for lane in lanes[1:] for tier in lane]
            print(f"tiers: {', '.join(beside)} beside the others; their output: "
                  f"{args.out}/TIER.log", flush=True)
        for thread in threads:
            thread.start()
        for tier in lanes[0]:
            print(f"\ntiers: {tier} tier", flush=True)
            state.run(tier, command(tier), None)
        for thread, lane in zip(threads, lanes[1:], strict=True):
            thread.join()
            for tier in lane:
                print(f"\ntiers: {tier} tier (ran beside the others)", flush=True)
                sys.stdout.buffer.write((args.out / f"{tier}.log").read_bytes())
                sys.stdout.flush()
    finally:
        state.stop()
    print()
    for tier in tiers:
        print(f"tiers: {tier}: exit {state.exits[tier]}, {state.seconds[tier] / 60:.1f} min")
    print(f"tiers: all: {(time.monotonic() - started) / 60:.1f} min")
    failed = [tier for tier in tiers if state.exits[tier]]
    if failed:
        print(f"make test: tiers that failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the tiers were stopped on the way out
        sys.exit(130)
