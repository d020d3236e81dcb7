"""What `testbed compose SCENARIO --up` costs where it runs the project in the User-Mode Linux
guest (this host's kernel has no sch_netem): the engine disk (made from nothing, then brought
up to date), the guest's engine start, the project's start until every worker shaped its links,
the whole run, the guest's memory, the disk's size; and what it measured on link 0->1.

Each run is `testbed compose SCENARIO -o DIR --up --sandbox uml --json`, the documented command,
in a subprocess; the first (`--fresh`, the default) starts without the engine disk, as a new
machine would (the debootstrap base and the wheels of scripts/compose-images.sh stay cached).
Writes benchmarks/results/compose-guest.md.

    .venv/bin/python -m benchmarks.compose_guest [--scenario quickstart] [--runs 2] [--no-fresh]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import Run
from testbed.compose.engine import DISK_NAME, cache_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compose-guest.md"
GiB = 1 << 30


def run_once(scenario: str, out: Path) -> tuple[dict[str, Any], float]:
    begun = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "testbed.cli", "compose", scenario, "-o", str(out), "--up",
         "--sandbox", "uml", "--json"], capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - begun
    if not result.stdout.strip():
        raise SystemExit(f"no report (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout), wall


def row(label: str, report: dict[str, Any], wall: float) -> str:
    costs = report["costs"]
    checks = {c["quantity"]: c for c in report["measured"]["checks"]}
    loss, delay = checks["loss"], checks["delay mean"]
    return (f"| {label} | {wall:.0f} | {costs['disk_seconds']:.0f} | "
            f"{costs['engine_seconds']:.1f} | {costs['up_to_shaped_seconds']:.0f} | "
            f"{costs['run_seconds']:.0f} | {costs['memory_used_peak_bytes'] / GiB:.2f} of "
            f"{costs['guest_memory_bytes'] / GiB:.0f} | {costs['disk_used_bytes'] / GiB:.2f} | "
            f"{loss['measured'] * 100:.2f}% ({'pass' if loss['passed'] else 'FAIL'}) | "
            f"{delay['measured'] * 1e3:.3f} ms ({'pass' if delay['passed'] else 'FAIL'}) | "
            f"{'yes' if report['success'] else 'NO'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="quickstart")
    parser.add_argument("--runs", type=int, default=2, help="runs in all (default 2)")
    parser.add_argument("--no-fresh", dest="fresh", action="store_false",
                        help="keep the engine disk for the first run too")
    args = parser.parse_args()
    run = Run.start("benchmarks.compose_guest")
    disk = cache_dir() / DISK_NAME
    if args.fresh:
        disk.unlink(missing_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compose-guest-") as work:
        for index in range(args.runs):
            label = "new disk" if args.fresh and index == 0 else "disk up to date"
            report, wall = run_once(args.scenario, Path(work) / f"run-{index}")
            rows.append(row(label, report, wall))
            print(rows[-1], flush=True)
    RESULTS.write_text("\n".join([
        *run.header(f"`testbed compose {args.scenario} --up` in the User-Mode Linux guest"),
        "Seconds of wall time. *disk*: making the engine disk (a new one: mkfs, the base "
        "imported, the worker and Prometheus images built) or checking it is up to date, on the "
        "host; *engine*: the guest's dockerd until it answers; *shaped*: `up -d` until every "
        "worker container has shaped its links; *run*: `up -d` until every worker ended; "
        "*memory*: the guest's peak in use (MemTotal - MemAvailable) of its GiB; *disk used*: "
        "the sparse disk's blocks; *loss*, *delay*: link 0->1 probed on the wire (workers "
        "paused), against the scenario's 1% and 5 ms.", "",
        "| run | wall | disk | engine | shaped | run | memory GiB | disk used GiB | loss | "
        "delay | success |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows, ""]))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
