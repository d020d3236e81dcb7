"""Link traces without root: both formats, their errors (file:line), the schedule's windows and
what `describe` reports."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netem.profile import LinkProfile
from netem.trace import (
    FLOOR_RATE,
    CsvTrace,
    MahimahiTrace,
    Replay,
    TraceError,
    load_trace,
    parse_trace,
    schedule,
)

DATA = Path(__file__).parent.parent / "data"


def test_mahimahi_file_rates_per_window_with_a_floor_where_none():
    trace = load_trace(DATA / "step.mahimahi")
    assert isinstance(trace, MahimahiTrace) and trace.length == 3.5
    plan = schedule(trace)
    rates = plan.values[:, 0]
    assert plan.fields == ("rate",) and plan.windows == 35 and plan.length == 3.5
    # The last opportunity (3500 ms) is the next loop's first: window 0 has 101 of them.
    assert rates[0] == 101 * 1500 * 8 / 0.1
    assert np.all(rates[1:20] == 12e6) and np.all(rates[20:30] == 6e6)
    assert np.all(rates[30:] == FLOOR_RATE)
    summary = plan.describe()
    assert (summary.length, summary.windows, summary.floor_windows) == (3.5, 35, 5)
    assert summary.max_rate == rates[0] and summary.min_rate == FLOOR_RATE
    assert summary.mean_rate == pytest.approx(rates.mean())


def test_mahimahi_partial_last_window_is_measured_over_its_own_length():
    plan = schedule(parse_trace("0\n10\n20\n130\n", "mahimahi"), 0.1)
    # 130 ms: a full window, then 30 ms; 130 % 130 lands in window 0 beside 0, 10 and 20.
    assert plan.windows == 2 and plan.length == 0.2
    assert plan.values[:, 0].tolist() == [4 * 12000 / 0.1, FLOOR_RATE]


def test_csv_sample_and_hold_with_empty_cells_keeping_the_value_before():
    text = "Time, rate ,delay,loss\n0.5,20mbit,,1%\n1s,,10ms,\n1500ms,5mbit,,\n2s,,,\n"
    trace = parse_trace(text, "csv", "t.csv")
    assert isinstance(trace, CsvTrace) and trace.length == 2.0
    plan = schedule(trace, 0.25)
    assert plan.fields == ("rate", "delay", "loss") and plan.windows == 8
    unset = -1.0
    assert plan.values.tolist() == [
        [unset, unset, unset], [unset, unset, unset],  # before the first row: the base's
        [20e6, unset, 0.01], [20e6, unset, 0.01],
        [20e6, 0.01, 0.01], [20e6, 0.01, 0.01],
        [5e6, 0.01, 0.01], [5e6, 0.01, 0.01],
    ]
    base = LinkProfile.parse(delay="50ms", rate="1mbit", limit=50)
    profiles, which = plan.profiles(base)
    at = [profiles[index] for index in which]
    assert at[0] == base
    assert at[2] == LinkProfile.parse(delay="50ms", rate="20mbit", loss="1%", limit=50)
    assert at[7] == LinkProfile.parse(delay="10ms", rate="5mbit", loss="1%", limit=50)
    assert len(profiles) == 4
    assert plan.describe().mean_rate == pytest.approx((2 * 20e6 + 2 * 20e6 + 2 * 5e6) / 6)


def test_step_csv_file_and_resolution_arithmetic():
    trace = load_trace(DATA / "step.csv")
    for resolution, windows in ((0.1, 40), (0.01, 400), (0.3, 14)):
        plan = schedule(trace, resolution)
        assert plan.windows == windows
        assert plan.resolution == resolution
        first_slow = int(np.argmax(plan.values[:, 0] == 5e6))
        assert first_slow == -(-2.0 // resolution)  # the first window starting at 2 s or later
    assert schedule(trace).describe().mean_rate == 12.5e6


@pytest.mark.parametrize("resolution", [0.009, 0.0, -1.0, float("nan")])
def test_resolution_below_10ms_is_refused(resolution):
    with pytest.raises(TraceError, match="resolution: expected at least 10ms"):
        schedule(load_trace(DATA / "step.csv"), resolution)


@pytest.mark.parametrize(("text", "error"), [
    ("10\n20\nabc\n", r"^m:3: expected a whole number of milliseconds, got 'abc'$"),
    ("10\n-5\n", r"^m:2: expected a whole number"),
    ("# from somewhere\n\n10\n30\n20\n", r"^m:5: 20 is before the timestamp above it \(30\)"),
    ("0\n0\n", r"^m:2: the last timestamp is the trace's length"),
    ("# nothing\n", r"^m: no delivery opportunity"),
    ("99999999999\n", r"^m:1: the trace lasts 99999999999ms; at most 86400000ms"),
    ("1.5\n", r"^m:1: expected a whole number"),
])
def test_mahimahi_errors_name_the_line(text, error):
    with pytest.raises(TraceError, match=error):
        parse_trace(text, "mahimahi", "m")


@pytest.mark.parametrize(("text", "error"), [
    ("", r"^c: empty"),
    ("time,speed\n0,1mbit\n1,1mbit\n", r"^c:1: unknown column 'speed'"),
    ("time,rate,rate\n", r"^c:1: column 'rate' named twice"),
    ("rate,delay\n", r"^c:1: the header names time and at least one of"),
    ("time\n0\n1\n", r"^c:1: the header names time and at least one of"),
    ("time,rate\n0,1mbit\n", r"^c: expected at least two rows"),
    ("time,rate\n0,1mbit\n\n1s,2mbit,3\n", r"^c:4: 3 cells, the header names 2"),
    ("time,rate\n0,1mbit\n,2mbit\n", r"^c:3: time: every row needs its time"),
    ("time,rate\n0,1mbit\n1s,100\n", r"^c:3: rate: '100' has no unit"),
    ("time,rate\n0,1mbit\n1s,0mbit\n", r"^c:3: rate: expected a rate"),
    ("time,delay\n0,5\n1,5ms\n", r"^c:2: delay: '5' has no unit"),
    ("time,loss\n0,150%\n1,1%\n", r"^c:2: loss: expected a percentage"),
    ("time,loss\n2s,1%\n1s,1%\n", r"^c:3: time '1s' is not after the row above's"),
    ("time,loss\n0,1%\n-1,1%\n", r"^c:3: time: expected a duration"),
    ("time,loss\n0,1%\n1e9,1%\n", r"^c:3: the trace lasts 1e\+09s; at most 86400s"),
])
def test_csv_errors_name_the_line(text, error):
    with pytest.raises(TraceError, match=error):
        parse_trace(text, "csv", "c")


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(TraceError, match=r"missing.csv: No such file"):
        load_trace(tmp_path / "missing.csv")
    binary = tmp_path / "trace"
    binary.write_bytes(b"10\n20\n\xff\n")
    with pytest.raises(TraceError, match=r"trace:3: not UTF-8 text"):
        load_trace(binary)
    with pytest.raises(TraceError, match=r"unknown trace format 'pcap'"):
        parse_trace("", "pcap")  # type: ignore[arg-type]


def test_profiles_that_the_base_cannot_take_name_the_time():
    plan = schedule(parse_trace("time,jitter\n0,1ms\n1s,\n", "csv", "j.csv"), 0.5)
    with pytest.raises(TraceError, match=r"(?s)^j.csv: at 0s the trace and the base profile make "
                                         r"no profile:.*jitter needs a delay"):
        plan.profiles(LinkProfile())
    profiles, _ = plan.profiles(LinkProfile.parse(delay="20ms"))
    assert profiles == [LinkProfile.parse(delay="20ms", jitter="1ms")]


def test_replay_checks_its_profiles_when_made():
    plan = schedule(parse_trace("time,loss\n0,1%\n1s,\n", "csv", "l.csv"))
    with pytest.raises(TraceError, match="give either loss"):
        Replay("eth0", LinkProfile.parse(gilbert_elliott={"p": "1%"}), plan)
    replay = Replay("eth0", LinkProfile(), plan, loop=False)
    assert replay.late.changes == 0 and replay.wait()  # not started: nothing to wait for


@settings(max_examples=300, deadline=None)
@given(text=st.text(), format=st.sampled_from(["mahimahi", "csv"]))
def test_junk_raises_only_trace_errors(text, format):
    with contextlib.suppress(TraceError):
        schedule(parse_trace(text, format, "junk"), 0.01).describe()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["0", "1", "10", "2s", "5mbit", "1%", "x", "", "-1", "1e400",
                                 "time", "rate", "loss", ",", "\n", "\r\n", '"', "\x00"]),
                max_size=40))
def test_csv_like_junk_raises_only_trace_errors(parts):
    with contextlib.suppress(TraceError):
        schedule(parse_trace("time,rate,loss\n" + "".join(parts), "csv", "junk"))
