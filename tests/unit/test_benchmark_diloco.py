"""The DiLoCo benchmark's records: a cell's outcome survives the disk whole, and the results
file is built from every process's records, naming each process and what is still missing."""

from __future__ import annotations

import math

import yaml

from benchmarks import diloco
from benchmarks.diloco import Cell, Outcome, Record
from testbed.scenario.load import load_scenario


def outcome(method: str, collective: str, perplexity: float, sent: float, seconds: float,
            curve: list[tuple[float, float]]) -> Outcome:
    return Outcome(Cell("10mbit-50ms-1%", method, collective, 11), "ok", "", perplexity, sent,
                   seconds, math.nan if method == "ddp" else 0.5, curve)


def record(result: Outcome, started: str, seconds: float) -> Record:
    return Record(result, 500, 25, started, seconds,
                  f"Written by `cmd`, started {started}, took {seconds / 60:.1f} min.")


def test_a_record_round_trips_with_its_curve_and_missing_figures(tmp_path):
    kept = record(outcome("ddp", "gloo", 9.5, math.nan, 100.0, [(10.0, 20.0), (90.0, 9.5)]),
                  "2026-11-28T10:00:00+00:00", 120.0)
    kept.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["ddp-gloo-10mbit-50ms-1pct-seed11.json"]
    loaded = Record.load(tmp_path / "ddp-gloo-10mbit-50ms-1pct-seed11.json")
    assert loaded.outcome.cell == kept.outcome.cell  # a Cell again, as plan() makes them
    assert loaded.outcome.curve == [(10.0, 20.0), (90.0, 9.5)]  # tuples, as run_cell makes
    assert math.isnan(loaded.outcome.bytes_sent) and math.isnan(loaded.outcome.outer_wait)
    assert (loaded.outcome.perplexity, loaded.outcome.training_seconds) == (9.5, 100.0)
    assert (loaded.steps, loaded.eval_every, loaded.started, loaded.seconds,
            loaded.written_by) == (kept.steps, kept.eval_every, kept.started, kept.seconds,
                                   kept.written_by)


def test_the_report_reads_every_process_records_in_the_plan_order(tmp_path):
    """Two processes (two guests) recorded cells; the file names both, with their cell counts,
    compares DiLoCo with DDP though DDP was written later, and says the benchmark is partial."""
    first, second = "2026-11-28T10:00:00+00:00", "2026-11-28T10:01:00+00:00"
    record(outcome("diloco-h50", "lossy", 10.0, 1e6, 30.0, [(15.0, 11.0), (30.0, 9.9)]),
           first, 60.0).save(tmp_path)
    record(outcome("ddp", "lossy", 9.9, 50e6, 300.0, [(150.0, 12.0), (300.0, 9.9)]),
           first, 400.0).save(tmp_path)
    record(outcome("ddp", "gloo", 9.5, math.nan, 600.0, [(600.0, 9.5)]),
           second, 700.0).save(tmp_path)
    records = diloco.load_records(tmp_path)
    assert [(r.outcome.cell.method, r.outcome.cell.collective) for r in records] == [
        ("ddp", "gloo"), ("ddp", "lossy"), ("diloco-h50", "lossy")]
    text = diloco.report(records, 500, 25, "Partial.", ["clean"])
    assert "took 6.7 min. Cells recorded: 2." in text  # the first process's latest record
    assert "took 11.7 min. Cells recorded: 1." in text
    assert "## clean (unshaped)" in text and "## 10mbit-50ms-1%" in text
    row = next(line for line in text.splitlines() if line.startswith("| diloco-h50 | lossy"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "1%"  # perplexity 10.0 against DDP's 9.9
    assert cells[6] == "50"  # DDP's 50 MB over 1 MB
    assert cells[7] == "0.1"  # DDP's final 9.9 reached at 30 s of DDP's 300 s


def test_every_cell_is_a_valid_scenario(tmp_path):
    """The plan's scenarios load: a field the runner would reject fails here, not hours in."""
    cells = diloco.plan(list(diloco.NETWORKS), list(diloco.METHODS), list(diloco.COLLECTIVES),
                        [11])
    assert len(cells) == 3 * 19
    for cell in cells:
        path = tmp_path / f"{cell.name}.yaml"
        path.write_text(yaml.safe_dump(cell.scenario(500, 25)))
        assert load_scenario(path).seed == 11


def test_diloco_h50_runs_on_where_its_wall_clock_is_the_target():
    """On the slow network DiLoCo H=50 trains REACH times the equal steps; a record of it from
    before it ran on is run again, the others are kept, and a skipped cell always runs again."""
    slow, clean = diloco.SLOW_NETWORK, "clean"
    assert Cell(slow, "diloco-h50", "gloo", 11).steps_run(500) == 500 * diloco.REACH
    assert Cell(slow, "diloco-h10", "gloo", 11).steps_run(500) == 500
    assert Cell(clean, "diloco-h50", "gloo", 11).steps_run(500) == 500
    assert diloco.REACH > 1

    def kept(network: str, method: str, steps_run: int, status: str = "ok") -> Record:
        result = Outcome(Cell(network, method, "lossy", 11), status, steps_run=steps_run)
        return Record(result, 500, 25, "2026-11-28T10:00:00+00:00", 1.0, "")

    records = [kept(slow, "diloco-h50", 0), kept(slow, "diloco-h10", 0),
               kept(clean, "diloco-h50", 500), kept(slow, "ddp", 500, "skipped")]
    assert diloco.recorded(records, 500) == {Cell(slow, "diloco-h10", "lossy", 11),
                                             Cell(clean, "diloco-h50", "lossy", 11)}
    records.append(kept(slow, "diloco-h50", 500 * diloco.REACH))
    assert Cell(slow, "diloco-h50", "lossy", 11) in diloco.recorded(records, 500)


def test_the_largest_lag_is_the_widest_spread_of_one_step_between_workers():
    import numpy as np

    steps = np.array([0, 0, 1, 1, 2, 2, 0, 1, 2], dtype=float)  # three workers, rank by rank
    times = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.5, 7.5, 5.5])
    assert diloco.largest_lag(steps, times) == 4.5  # step 1: 3.0 against 7.5
    assert math.isnan(diloco.largest_lag(steps[:0], times[:0]))


def test_a_streaming_wait_is_reported_with_what_the_call_had_to_fit_in(tmp_path):
    """The streaming target names the longest outer all-reduce and the workers' largest gap,
    from the runs that recorded them (records from before carry neither)."""
    old = outcome("streaming", "gloo", 10.0, math.nan, 200.0, [(200.0, 10.0)])
    new = Outcome(Cell("10mbit-50ms-1%", "streaming", "gloo", 12), "ok", "", 10.1, math.nan,
                  190.0, 0.0, [(190.0, 10.1)], outer_call=1.25, worker_lag=3.5)
    for result in (old, new):
        record(result, "2026-11-28T10:00:00+00:00", 300.0).save(tmp_path)
    text = diloco.report(diloco.load_records(tmp_path), 500, 25, "", ["10mbit-50ms-1%"])
    line = next(x for x in text.splitlines() if x.startswith("- Streaming DiLoCo"))
    assert "0.500 s over 2 runs: **missed**" in line
    assert "longest outer all-reduce 1.25 s" in line and "at one step 3.50 s (1 of" in line
