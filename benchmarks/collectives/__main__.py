"""The collectives benchmark's command line: the cells of the plan, lab by lab, then the results
file (`results` or, with --grid, `grid_results`); an interrupted run keeps what finished."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks import collectives as benchmark
from benchmarks.collectives.cells import (
    GRID_KINDS,
    GRID_RATE,
    GRID_WORLDS,
    KINDS,
    LOSSES,
    RATES,
    SIZES,
    TCP_CONGESTION,
    Outcome,
    rate_name,
    show,
    size_name,
    verdict,
)
from benchmarks.collectives.grid_results import grid_report, grid_targets
from benchmarks.collectives.plan import hopeless, plan
from benchmarks.collectives.results import report, targets
from benchmarks.collectives.runner import MTU, REPO, run_cell, shape
from benchmarks.report import Run
from netem.profile import DEFAULT_LIMIT

RESULTS = REPO / "benchmarks" / "results" / "collectives.md"
GRID_RESULTS = REPO / "benchmarks" / "results" / "collectives-moshpit-grid.md"


def progress(outcome: Outcome, opening: str) -> None:
    """One line on stderr per cell as it ends: where it ran, what it came to, how long."""
    cell = outcome.cell
    note = f" [{outcome.note}]" if outcome.note and outcome.status != "skipped" else ""
    phases = outcome.counters if outcome.status == "ok" else {}
    if "gather_seconds" in phases:
        note += (f" [slowest gather {phases['gather_seconds']:.3g} s, broadcast "
                 f"{phases['broadcast_seconds']:.3g} s]")
    print(f"{opening} {rate_name(cell.rate)}, loss {cell.loss:.0%}, "
          f"{size_name(cell.numel)}, {cell.kind}: {show(outcome)}{note} ({outcome.wall:.0f} s)",
          file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                                     description=benchmark.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1M and 10M, 100 Mbit/s at 0%% and 10%% loss, and unshaped")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated collectives to run (default: {','.join(KINDS)})")
    parser.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default: all)")
    parser.add_argument("--rates", help="comma-separated, of " + ", ".join(
        [*(name.replace(" ", "") for name in RATES), "unshaped"]) + " (default: all)")
    parser.add_argument("--losses", help="comma-separated loss percentages, of "
                        + ",".join(f"{x * 100:g}" for x in LOSSES) + " (default: all)")
    parser.add_argument("--logs", type=Path,
                        help="keep every worker's output (one JSON line per call) here")
    parser.add_argument("--grid", nargs="?", const=",".join(map(str, GRID_WORLDS)),
                        help="only Moshpit on a grid of groups of four, with these many peers "
                        f"(default {','.join(map(str, GRID_WORLDS))}), every peer's downlink "
                        "and uplink at 100 Mbit/s, 1M and 10M")
    parser.add_argument("--grid-rate", type=float, default=GRID_RATE / 1e6,
                        help="--grid: Mbit/s on every downlink and uplink (default %(default)g)")
    parser.add_argument("--congestion", default=TCP_CONGESTION,
                        help="TCP congestion control of the ring's and Moshpit's sockets "
                        "(default %(default)s; one of the kernel's available ones)")
    parser.add_argument("--queue-limit", type=int, default=DEFAULT_LIMIT,
                        help="--grid: packets each shaped link's queue holds "
                        "(default %(default)s, netem's)")
    parser.add_argument("--no-idle-restart", action="store_true",
                        help="--grid: TCP keeps its congestion window over an idle pause "
                        "(net.ipv4.tcp_slow_start_after_idle=0 in every namespace; the "
                        "kernel's default restarts it)")
    args = parser.parse_args()
    if not args.grid and (args.no_idle_restart or args.queue_limit != DEFAULT_LIMIT):
        parser.error("--queue-limit and --no-idle-restart go with --grid")
    if not 1 <= args.queue_limit <= 10**6:
        parser.error(f"--queue-limit: expected 1..1000000 packets, got {args.queue_limit}")
    if args.grid and args.kinds == parser.get_default("kinds"):
        args.kinds = ",".join(GRID_KINDS)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds: expected some of {', '.join(KINDS)}, got {args.kinds!r}")
    sizes = _choices(parser, "--sizes", args.sizes, list(SIZES))
    rate_names = {name.replace(" ", ""): name for name in RATES} | {"unshaped": "unshaped"}
    rates = _choices(parser, "--rates", args.rates, list(rate_names))
    rates = None if rates is None else [rate_names[r] for r in rates]
    percents = _choices(parser, "--losses", args.losses, [f"{x * 100:g}" for x in LOSSES])
    losses = None if percents is None else [float(p) / 100 for p in percents]
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces and shaping")
    from netem.lab import Lab

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through every cleanup below, as Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    run = Run.start("benchmarks.collectives")
    try:
        grid = [int(x) for x in args.grid.split(",")] if args.grid else []
    except ValueError:
        parser.error(f"--grid: expected comma-separated peer counts, got {args.grid!r}")
    write = grid_report if grid else report
    if grid and args.out == RESULTS:
        args.out = GRID_RESULTS
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    if args.congestion not in available:
        parser.error(f"--congestion: expected one of {', '.join(available)} (this kernel's), "
                     f"got {args.congestion!r}")
    groups = [(rate, loss, [replace(cell, congestion=args.congestion,
                                    queue_limit=args.queue_limit,
                                    idle_restart=not args.no_idle_restart)
                            for cell in cells])
              for rate, loss, cells in plan(args.quick, kinds, sizes, rates, losses, grid,
                                            args.grid_rate * 1e6)]
    if not groups:
        parser.error("no cell left to run: --sizes, --rates and --losses exclude them all")
    total = sum(len(cells) for _, _, cells in groups)
    outcomes: list[Outcome] = []
    port = 30000
    try:
        with tempfile.TemporaryDirectory(prefix="tb-collectives-") as tmp:
            logs = args.logs or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            for rate, loss, cells in groups:
                with Lab(cells[0].world, mtu=MTU) as lab:
                    shape(lab, rate, loss, cells[0].uplinks, cells[0].queue_limit,
                          cells[0].idle_restart)
                    for cell in cells:
                        earlier = hopeless(cell, outcomes)
                        if earlier is not None:
                            outcome = Outcome(cell, "skipped", note=(
                                f"timed out at {size_name(earlier.cell.numel)}, "
                                f"{earlier.cell.loss:.0%}"))
                        else:
                            outcome = run_cell(lab, cell, port, logs)
                            port += 10
                        outcomes.append(outcome)
                        progress(outcome, run.progress(len(outcomes), total))
    except KeyboardInterrupt:
        if outcomes:  # what finished is kept, beside the results, never over them
            partial = args.out.with_suffix(".partial.md")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(write(outcomes, run, note=f"Interrupted after {len(outcomes)} "
                                     f"of {total} cells: a partial run."))
            print(f"interrupted; wrote {partial}", file=sys.stderr)
        raise SystemExit(130) from None
    text = write(outcomes, run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    for ok, line in (grid_targets if grid else targets)(outcomes):
        print(f"{verdict(ok)}: {line}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)


def _choices(parser: argparse.ArgumentParser, flag: str, value: str | None,
             allowed: list[str]) -> list[str] | None:
    """A comma-separated flag's values, each one of `allowed`; None when not given."""
    if value is None:
        return None
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}: expected some of {', '.join(allowed)}, got {value!r}")
    return chosen


if __name__ == "__main__":
    main()
