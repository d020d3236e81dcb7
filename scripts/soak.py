#!/usr/bin/env python3
"""Run test tiers several times, optionally while a CPU-bound process keeps one core busy, and
print how often each test failed. A test that fails in any run is a bug to fix at its cause:
this is how flaky tests are found before CI finds them (`make soak`, README "Test tiers").

Standard library only: it runs before and beside the project's own venv."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from tiers import ROOT, TIERS

# Spins until its parent (this script) is gone, so an interrupted soak leaves no load behind.
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"


def failures(report: Path) -> list[str]:
    """The node ids of the tests that failed or errored in one JUnit XML report."""
    if not report.exists():
        return ["<no report: the tier did not run to its end>"]
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(f"{case.get('classname')}::{case.get('name')}")
    return found


def run_tier(tier: str, index: int, out: Path) -> tuple[int, list[str], float]:
    report = out / f"{tier}-{index}.xml"
    log = out / f"{tier}-{index}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        code = subprocess.run([*TIERS[tier], f"--junitxml={report}", "-p", "no:cacheprovider"],
                              cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                              env={**os.environ, "CI": "true"}).returncode
    return code, failures(report) if code else [], time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="unit,netns,compose,guest",
                        help="comma-separated, of: " + ", ".join(TIERS))
    parser.add_argument("--runs", default="5,5,3,3",
                        help="runs per tier, one number or one per tier (default 5,5,3,3)")
    parser.add_argument("--load", type=int, default=1,
                        help="CPU-bound processes kept busy meanwhile (default 1: one core)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "soak",
                        help="where the reports and logs go (default build/soak)")
    args = parser.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        parser.error(f"--tiers: unknown {unknown}; allowed: {', '.join(TIERS)}")
    runs = [int(n) for n in args.runs.split(",")]
    if len(runs) == 1:
        runs *= len(tiers)
    if len(runs) != len(tiers) or min(runs) < 1:
        parser.error(f"--runs: one positive count, or one per tier ({len(tiers)})")
    args.out.mkdir(parents=True, exist_ok=True)
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
    counts: dict[str, Counter[str]] = {}
    try:
        for tier, n in zip(tiers, runs, strict=True):
            counts[tier] = Counter()
            for index in range(1, n + 1):
                code, failed, seconds = run_tier(tier, index, args.out)
                counts[tier].update(failed)
                print(f"soak: {tier} run {index}/{n}: exit {code}, {len(failed)} failed, "
                      f"{seconds / 60:.1f} min ({args.out}/{tier}-{index}.log)", flush=True)
    finally:
        for process in load:
            process.send_signal(signal.SIGTERM)
            process.wait()
    total = 0
    for tier, n in zip(tiers, runs, strict=True):
        print(f"\n{tier}: {n} runs, {sum(counts[tier].values())} failures")
        for test, times in counts[tier].most_common():
            print(f"  {times}/{n}  {test}")
        total += sum(counts[tier].values())
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
