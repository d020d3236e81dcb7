"""The Moshpit grid benchmark's pure parts: where a call's time goes (each round against its
own bound, the rest of the call, TCP's counters per call and peer), the queue and idle-restart
settings it ran with, and its new flags' errors."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.collectives.cells import Cell, Outcome
from benchmarks.collectives.grid_results import grid_report, round_bound
from benchmarks.collectives.runner import REPO
from benchmarks.report import Run


def outcome(kind: str, **cell_fields) -> Outcome:
    cell = Cell(kind, 1_000_000, 100e6, 0.0, world=8, uplinks=True, **cell_fields)
    return Outcome(cell, "ok", seconds=[1.0, 1.2], counters={
        "netns_sent_segments": 16_000.0, "netns_retransmitted_segments": 80.0,
        "netns_timeouts": 4.0, "netns_loss_probes": 8.0})


def section(text: str) -> list[str]:
    tail = text.split("### Where a call's time goes", 1)[1]
    return [line for line in tail.splitlines() if line.startswith("- ")]


def test_each_round_is_set_against_its_own_groups_bound():
    moshpit = outcome("moshpit")
    moshpit.round_seconds, moshpit.outside_rounds = [(0.6, 0.01, 0.3), (0.4, 0.002, 0.2)], 0.05
    moshpit.start_skew, moshpit.after_last_start = 0.008, 1.0
    # 4x2: a group of four receives 1.5 tensors of 4 MB, a group of two 1, at 12.5 MB/s
    assert round(round_bound(moshpit, 0), 6) == 0.48 and round(round_bound(moshpit, 1), 6) == 0.32
    first, ring = section(grid_report([moshpit, outcome("ring")],
                                      Run.start("benchmarks.collectives")))
    assert first == ("- moshpit, 8 peers, 1M: the peers began a call within 8 ms of each other; "
                     "from the last one's start to the last end 1 s (0.80 of the bound); "
                     "round 1 (a group of 4) 0.6 s against its 0.48 s "
                     "(0.80): roll call 10 ms, reduce-scatter 0.3 s, all-gather 0.29 s; round 2 "
                     "(a group of 2) 0.4 s against its 0.32 s (0.80): roll call 2 ms, "
                     "reduce-scatter 0.2 s, all-gather 0.198 s; outside "
                     "the rounds 50 ms; per call and peer 1,000 segments sent, 5.0 "
                     "retransmitted, 0.25 retransmission timeouts, 0.50 tail loss probes")
    assert ring.startswith("- ring, 8 peers, 1M: the peers began a call within nan ms of each "
                           "other; from the last one's start to the last end nan s (nan of the "
                           "bound); per call and peer 1,000 segments sent")


def test_the_header_says_the_queue_and_whether_the_window_restarts():
    default = grid_report([outcome("ring")], Run.start("benchmarks.collectives"))
    assert "queues up to 1000 packets" in default and "121 ms" in default
    assert "restarts after an idle retransmission timeout" in default
    tuned = grid_report([outcome("ring", queue_limit=100, idle_restart=False)],
                        Run.start("benchmarks.collectives"))
    assert "queues up to 100 packets" in tuned and "12 ms" in tuned
    assert "tcp_slow_start_after_idle=0" in tuned


def test_the_queue_flags_name_what_is_allowed():
    for flags, named in ((["--queue-limit", "100"], "go with --grid"),
                         (["--no-idle-restart"], "go with --grid"),
                         (["--grid", "8", "--queue-limit", "0"],
                          "--queue-limit: expected 1..1000000 packets, got 0")):
        result = subprocess.run([sys.executable, "-m", "benchmarks.collectives", *flags],
                                capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 2 and named in result.stderr, result.stderr
