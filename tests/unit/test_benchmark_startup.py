"""The start-up benchmark's pure parts: a run directory's records read into its times, the
table's row and the targets' verdicts."""

from __future__ import annotations

import dataclasses

from benchmarks import startup
from testbed.report import RunWriter


def written_run(tmp_path, ready: float) -> RunWriter:
    """A two-worker run: cluster up at 1 s, workers ready at `ready`, steps from ready + 0.5."""
    run = RunWriter.create(tmp_path / "run")
    run.event("cluster", t=1.0)
    for rank in (0, 1):
        with RunWriter.open(run.run_dir, rank=rank) as worker:
            stages = dict(zip(startup.STAGES, (1.5, 1.6, 2.0 + rank, 3.0, ready), strict=True))
            worker.event("startup", rank=rank, rejoin=False, **stages)
            for step in range(3):
                worker.event("step", t=ready + 0.5 + step + rank * 0.1, rank=rank, step=step,
                             loss=1.0)
    run.end(True, t=ready + 5.0)
    run.close()
    return run


def test_a_runs_records_give_its_times(tmp_path):
    run = written_run(tmp_path, ready=6.0)
    timing = startup.read_timing(run.run_dir, "guest", wall=19.0, success=True)
    assert timing.cluster == 1.0
    assert timing.stages == {"entered": 1.5, "loaded": 1.6, "connected": 2.5, "built": 3.0,
                             "ready": 6.0}
    assert (timing.first_step, timing.last_step, timing.end) == (6.5, 8.6, 11.0)
    assert timing.outside == 8.0
    assert startup.row(timing).startswith("| guest | 19.0 | 8.0 | 1.0 | 1.5 | 1.6 | 2.5 | 3.0 "
                                          "| 6.0 | 6.5 | 5.5 | 2.1 | 2.4 | 11.0 | yes |")


def test_the_targets_are_met_or_missed_by_the_medians(tmp_path):
    met = startup.read_timing(written_run(tmp_path, ready=6.0).run_dir, "guest", 19.0, True)
    slow = dataclasses.replace(met, first_step=met.cluster + 9.0, wall=25.0)
    host = dataclasses.replace(met, where="host")
    said = startup.verdicts([met, host])
    assert said[0] == ("- guest: the largest spans (medians): outside the run's clock 8.0 s; "
                       "built until ready 3.0 s; after the last step 2.4 s.")
    assert said[1].endswith("target 8 s met.") and said[2].endswith("target 20 s met.")
    assert said[3].startswith("- host:") and len(said) == 5
    said = startup.verdicts([slow, slow, met])
    assert "first step 9.0 s" in said[1] and said[1].endswith("missed.")
    assert said[2].endswith("target 20 s missed.")


def test_the_spans_add_up_to_the_wall_time(tmp_path):
    timing = startup.read_timing(written_run(tmp_path, ready=6.0).run_dir, "guest", 19.0, True)
    spans = startup.spans(timing)
    assert sum(spans.values()) == timing.wall
    assert spans["connected until built"] == 0.5 and spans["built until ready"] == 3.0
