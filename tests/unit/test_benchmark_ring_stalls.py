"""The ring-stall benchmark's pure parts: a loss's row (calls past each threshold, where the
ring broke, the retransmission timeouts) and its flags' errors."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import ring_stalls
from benchmarks.report import Run


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "%" in line]


def test_a_losss_row_counts_the_slow_calls_and_says_where_the_ring_broke():
    whole = ring_stalls.Outcome(3.0, [0.1, 0.2, 1.5, 6.0, 40.0], "", 12, [204.0, 408.0, 204.0])
    broke = ring_stalls.Outcome(20.0, [2.0], "call 1: rank 0: the time limit passed", 7,
                                [600.0])
    text = ring_stalls.report([whole, broke], Run.start("benchmarks.ring_stalls"), 4810, 120)
    first, second = rows(text)
    assert first == ("| 3% | 5 | no | 9.560 | 1.500 | 38.64 | 40.00 | 3 | 2 | 1 | 12 | 204 "
                     "| 408 |")
    assert second.startswith("| 20% | 1 | call 1: rank 0: the time limit passed | 2.000 |")
    assert "allowed 120 s" in text and "4810 floats" in text


def test_a_ring_that_broke_at_its_first_call_still_gets_a_row():
    none = ring_stalls.Outcome(30.0, [], "call 0: rank 2: the time limit passed", 0, [])
    (row,) = rows(ring_stalls.report([none], Run.start("benchmarks.ring_stalls"), 10, 5))
    assert row.startswith("| 30% | 0 | call 0: rank 2: the time limit passed | nan |")


def test_bad_flags_name_the_flag_and_what_is_allowed():
    for flags, named in ((["--losses", "ten"], "--losses: expected comma-separated"),
                         (["--losses", "100"], "--losses: expected percentages in [0, 100)"),
                         (["--calls", "0"], "--calls: expected at least 1")):
        result = subprocess.run([sys.executable, "-m", "benchmarks.ring_stalls", *flags],
                                capture_output=True, text=True, cwd=ring_stalls.REPO)
        assert result.returncode == 2 and named in result.stderr, result.stderr
