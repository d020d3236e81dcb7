#!/usr/bin/env python3
"""Run the test tiers (`make test`): the guest tier in its User-Mode Linux guest beside the
compose and host tiers, which run one after the other, in that order.

The guest has one CPU (UML is not SMP) and keeps one core busy for its whole tier; the others
run niced on what is left, so the guest's timed checks see the CPU they would see alone, and the
others see one busy core, as `make soak` runs them. The compose tier goes first: it mostly waits
(for its engine, containers and guest), so it loses little beside the guest, and the host tier,
which keeps more than one core busy, has both once the guest is done. `--serial` runs the tiers
one after another instead.

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
TIERS = {
    "host": [str(VENV / "bin/python"), "-m", "pytest", "-m",
             "not netem_kernel and not compose and not gpu", "tests"],
    "compose": [str(VENV / "bin/python"), "-m", "pytest", "-m", "compose", "tests"],
    "guest": [str(VENV / "bin/testbed"), "sandbox", "pytest", "-m", "netem_kernel", "tests"],
}
BESIDE = "guest"  # the tier that runs beside the others
NICE = 10  # the others' niceness: the guest's one CPU goes first


def _stamp_end(process: subprocess.Popen[bytes], ended: list[float]) -> None:
    """Note when `process` ends: its tier's time, though it is read after the others end."""
    process.wait()
    ended.append(time.monotonic())


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the tier's process group (the sandbox turns it into a clean exit: the guest
    powered off, its directory removed), then its exit."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="compose,host,guest",
                        help="comma-separated, in the order to run them, of: "
                             + ", ".join(TIERS) + " (default compose,host,guest)")
    parser.add_argument("--serial", action="store_true",
                        help="one tier after another, none niced")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "tiers",
                        help=f"where the {BESIDE} tier's log goes when it runs beside the "
                             "others (default build/tiers)")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        parser.error(f"--tiers: unknown {unknown or 'none given'}; allowed: {', '.join(TIERS)}")

    # A CI job's timeout (SIGTERM) unwinds as Ctrl-C does: no guest is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    beside = BESIDE in tiers and len(tiers) > 1 and not args.serial
    started = time.monotonic()
    exits: dict[str, int] = {}
    seconds: dict[str, float] = {}
    background = None
    ended: list[float] = []  # when the tier beside ended, stamped as it ends
    log = args.out / f"{BESIDE}.log"
    try:
        if beside:
            args.out.mkdir(parents=True, exist_ok=True)
            print(f"tiers: the {BESIDE} tier runs beside the others; its output: {log}",
                  flush=True)
            with log.open("wb") as sink:
                background = subprocess.Popen(TIERS[BESIDE], cwd=ROOT, stdout=sink,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True)
            stamper = threading.Thread(target=_stamp_end, args=(background, ended), daemon=True)
            stamper.start()
        for tier in tiers:
            if beside and tier == BESIDE:
                continue
            print(f"\ntiers: {tier} tier", flush=True)
            begun = time.monotonic()
            # nice(1), not preexec_fn: a thread runs here, and preexec_fn is unsafe beside one
            niced = ["nice", "-n", str(NICE)] if beside else []
            exits[tier] = subprocess.run([*niced, *TIERS[tier]], cwd=ROOT).returncode
            seconds[tier] = time.monotonic() - begun
        if background is not None:
            stamper.join()
            exits[BESIDE] = background.returncode
            seconds[BESIDE] = ended[0] - started
            print(f"\ntiers: {BESIDE} tier (ran beside the others)", flush=True)
            sys.stdout.buffer.write(log.read_bytes())
            sys.stdout.flush()
    finally:
        if background is not None:
            _stop(background)
    print()
    for tier in tiers:
        print(f"tiers: {tier}: exit {exits[tier]}, {seconds[tier] / 60:.1f} min")
    print(f"tiers: all: {(time.monotonic() - started) / 60:.1f} min")
    failed = [tier for tier in tiers if exits[tier]]
    if failed:
        print(f"make test: tiers that failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
