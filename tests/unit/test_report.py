"""The run report: a synthetic run written through the writer API (several workers, a fault,
link measurements) reads back field for field, summarizes to figures computed here by hand,
renders valid PNGs and a page that shows them; several runs compare in one set of plots; bad
files give errors naming file and line, a killed writer's partial line is tolerated and said."""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from testbed.cli import app
from testbed.collectives.base import AllReduceStats
from testbed.report import (
    RunError,
    RunWriter,
    describe_runs,
    load_run,
    render_comparison,
    render_run,
)
from testbed.report.page import format_value, labels_for
from testbed.train.job import StepRecord

PNG = b"\x89PNG\r\n\x1a\n"
WORKERS, STEPS = 3, 12
PLOT_NAMES = ("loss", "network", "drift", "stragglers", "links")


class FakeClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.value = start

    def __call__(self) -> float:
        return self.value


def loss_of(rank: int, step: int, loss_rate: float) -> float:
    return 2.5 * math.exp(-step / (6 * (1 + 4 * loss_rate))) + 0.05 * rank + 0.3


def record(rank: int, step: int, loss_rate: float, local: bool = False) -> StepRecord:
    stats = None if local else AllReduceStats(
        "lossy", step, seconds=0.01 * (rank + 1), bytes_sent=1000 + step,
        bytes_received=900 + rank, coverage=1 - loss_rate, peers_missing=(2,) if step == 5 else (),
        extra={"datagrams_lost": float(step % 3 + rank), "tcp_retransmits": float(step),
               "rounds": 2.0, "shard_coverage": 0.9 - 0.1 * rank, "loss": 99.0},
    )
    return StepRecord(
        rank=rank, step=step, loss=loss_of(rank, step, loss_rate),
        compute_seconds=0.02 + 0.01 * rank, wait_seconds=0.005 * (step % 4 + 1) + 0.01 * rank,
        step_seconds=0.05 + 0.01 * rank, injected_delay_seconds=0.004 * rank * (step % 2),
        micro_batches=4 - (rank == 2 and step % 2), micro_batches_dropped=int(rank == 2
                                                                               and step % 2),
        threshold_seconds=0.03 if rank == 2 else None, stats=stats,
        evaluation={"loss": 1.5 - 0.01 * step, "perplexity": math.exp(1.5 - 0.01 * step)}
        if step == STEPS - 1 else {},
    )


def write_run(directory: Path, name: str, loss_rate: float, finish: bool = True) -> Path:
    """A run as the cluster runner writes it: the parent creates it and measures links; each
    worker appends its steps to its own file; a fault mid-run; the parent finishes it."""
    clock = FakeClock()
    parent = RunWriter.create(directory, scenario={"name": name, "workers": WORKERS,
                                                    "faults": [{"at": "0.5s", "kill": 1}]},
                              name=name, clock=clock, congestion_control="cubic")
    workers = [RunWriter.open(directory, rank=rank, clock=clock) for rank in range(WORKERS)]
    parent.link(0, 1, configured_loss=loss_rate, measured_loss=loss_rate * 0.9 + 0.001,
                probes=5000)
    parent.link("h1", "h2", configured_loss=loss_rate / 2, measured_loss=loss_rate / 2 + 0.002)
    for step in range(STEPS):
        clock.value += 0.1
        if step == 6:
            parent.fault("set", scheduled=0.6, link="0<->1", set={"loss": "10%"})
            parent.link(0, 1, configured_loss=0.10, measured_loss=0.104)  # measured again
        for rank, writer in enumerate(workers):
            writer.step(record(rank, step, loss_rate, local=(step == 3)),
                        drift=0.01 * step * (1 + rank) * (1 + 10 * loss_rate))
    for writer in workers:
        writer.end(success=True)
        writer.close()
    if finish:
        parent.finish()
    else:
        parent.close()
    return directory


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "lossy-5", "lossy-5", 0.05)


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_the_layout_is_one_events_file_per_writer_and_the_scenario(run_dir: Path):
    files = sorted(p.name for p in run_dir.iterdir())
    assert files == ["events-rank0.jsonl", "events-rank1.jsonl", "events-rank2.jsonl",
                     "events.jsonl", "plots", "scenario.yaml", "summary.json"]
    first = json.loads(lines(run_dir / "events.jsonl")[0])
    assert first == {"type": "run", "t": 0.0, "name": "lossy-5", "started": 1_700_000_000.0,
                     "format": 1, "congestion_control": "cubic"}
    assert "kill: 1" in (run_dir / "scenario.yaml").read_text()
    assert len(lines(run_dir / "events-rank1.jsonl")) == STEPS + 1  # steps and its end


def test_a_run_reads_back_field_for_field(run_dir: Path):
    run = load_run(run_dir)
    assert run.name == "lossy-5" and run.warnings == []
    assert [(s.rank, s.step) for s in run.steps] == [
        (r, s) for r in range(WORKERS) for s in range(STEPS)]
    step = run.steps[STEPS + 5]  # rank 1, step 5
    expected = record(1, 5, 0.05)
    assert (step.rank, step.step, step.loss) == (1, 5, expected.loss)
    assert step.t == pytest.approx(0.6)
    assert step.wait_seconds == expected.wait_seconds
    assert step.bytes_sent == 1005 and step.bytes_received == 901
    assert step.collective == "lossy" and step.peers_missing == (2,)
    assert step.extra == {"datagrams_lost": 3.0, "tcp_retransmits": 5.0, "rounds": 2.0,
                          "shard_coverage": pytest.approx(0.8),
                          "stats_loss": 99.0}  # `loss` of the stats must not shadow the step's
    assert step.drift == pytest.approx(0.01 * 5 * 2 * 1.5)
    local = run.steps[3]
    assert local.collective is None and local.extra == {} and local.bytes_sent == 0
    assert run.steps[STEPS - 1].evaluation["perplexity"] == pytest.approx(math.exp(1.39))
    [fault] = run.faults
    assert (fault.action, fault.scheduled, fault.target) == ("set", 0.6, "0<->1")
    assert fault.t == pytest.approx(0.7)
    assert fault.fields["set"] == {"loss": "10%"}
    assert [(link.label, link.configured_loss, link.t) for link in run.links] == [
        ("0→1", 0.05, 0.0), ("h1→h2", 0.025, 0.0), ("0→1", 0.10, pytest.approx(0.7))]
    assert run.links[0].fields == {"probes": 5000}
    assert {(e.rank, e.success) for e in run.ends} == {(0, True), (1, True), (2, True),
                                                       (None, True)}


def test_the_summary_holds_the_figures_computed_by_hand(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    finals = [loss_of(rank, STEPS - 1, 0.05) for rank in range(WORKERS)]
    assert summary["final_loss"] == pytest.approx(np.mean(finals))
    assert summary["success"] is True and summary["workers"] == WORKERS
    assert summary["steps"] == STEPS and summary["faults"] == 1
    # Rank 2 drops one of 4 micro-batches on odd steps: 6 of 48 of its, 6 of 144 overall.
    assert summary["drop_rate"] == pytest.approx(6 / 144)
    assert summary["per_worker"][2]["drop_rate"] == pytest.approx(6 / 48)
    assert summary["per_worker"][0]["drop_rate"] == 0
    # datagrams_lost is per step (summed, the local step 3 has none); tcp_retransmits counts
    # since the sockets opened (its last value).
    lost = sum(step % 3 + rank for rank in range(WORKERS) for step in range(STEPS) if step != 3)
    assert summary["datagrams_lost"] == lost
    assert summary["tcp_retransmits"] == WORKERS * (STEPS - 1)
    # shard_coverage describes one step: a worker's figure is its mean, the run's their mean.
    assert [w["shard_coverage"] for w in summary["per_worker"]] == pytest.approx([0.9, 0.8, 0.7])
    assert summary["shard_coverage"] == pytest.approx(0.8)
    assert summary["bytes_sent"] == WORKERS * sum(1000 + s for s in range(STEPS) if s != 3)
    assert summary["mean_step_seconds"] == pytest.approx(0.06)
    assert summary["wall_seconds"] == pytest.approx(STEPS * 0.1)
    assert summary["final_eval_perplexity"] == pytest.approx(math.exp(1.39))
    assert [w["final_loss"] for w in summary["per_worker"]] == pytest.approx(finals)
    assert all(w["success"] is True for w in summary["per_worker"])


def test_a_worker_reporting_failure_fails_the_run(tmp_path: Path):
    parent = RunWriter.create(tmp_path / "r", clock=FakeClock())
    worker = RunWriter.open(tmp_path / "r", rank=0, clock=FakeClock())
    worker.step(record(0, 0, 0.0))
    parent.end(success=False, rank=1, error="killed by signal 9")  # on a worker's behalf
    summary = parent.finish()
    assert summary["success"] is False
    worker.close()


def test_a_new_run_refuses_a_directory_that_holds_one(run_dir: Path):
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunWriter.create(run_dir)


def test_render_writes_valid_pngs_and_a_page_with_every_plot_and_figure(run_dir: Path):
    rendered = render_run(run_dir)
    assert rendered.html == run_dir / "index.html"
    assert sorted(rendered.plots) == sorted(PLOT_NAMES) and rendered.skipped == {}
    page = rendered.html.read_text()
    for name in PLOT_NAMES:
        png = run_dir / "plots" / f"{name}.png"
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
        assert f'src="plots/{name}.png"' in page
    summary = json.loads((run_dir / "summary.json").read_text())
    for key, cell in (("final_loss", f"{summary['final_loss']:.4f}"),
                      ("mean_step_seconds", f"{summary['mean_step_seconds']:.4f}"),
                      ("final_eval_perplexity", f"{summary['final_eval_perplexity']:.3f}"),
                      ("datagrams_lost", f"{round(summary['datagrams_lost']):,}")):
        assert f"<td>{cell}</td>" in page, key
    assert "worker 2" in page and "0→1" in page and "kill: 1" in page


def test_figures_are_formatted_for_people():
    assert format_value(None, ".4f") == "–"
    assert format_value(1234.6, "int") == "1,235"
    assert format_value(True, "bool") == "yes" and format_value(False, "bool") == "no"
    assert format_value(999, "bytes") == "999 B"
    assert format_value(1_500_000, "bytes") == "1.5 MB"
    assert format_value(0.123456, ".3f") == "0.123"


def test_rendering_elsewhere_leaves_the_run_directory_alone(run_dir: Path, tmp_path: Path):
    before = sorted(p.name for p in run_dir.rglob("*"))
    rendered = render_run(run_dir, tmp_path / "elsewhere")
    assert rendered.html == tmp_path / "elsewhere" / "index.html"
    assert (tmp_path / "elsewhere" / "plots" / "loss.png").read_bytes().startswith(PNG)
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_plot_without_data_is_left_out_and_said(tmp_path: Path):
    parent = RunWriter.create(tmp_path / "bare", clock=FakeClock())
    parent.step(record(0, 0, 0.0))  # no drift, no links
    parent.finish()
    rendered = render_run(tmp_path / "bare")
    assert sorted(rendered.plots) == ["loss", "network", "stragglers"]
    assert not (tmp_path / "bare" / "plots" / "drift.png").exists()
    assert "not drawn (no link measurements; " in rendered.html.read_text()


def test_runs_compare_in_one_set_of_plots_labelled_by_run(tmp_path: Path):
    runs = [write_run(tmp_path / f"loss-{p}", f"loss {p}%", p / 100) for p in (0, 5, 10)]
    rendered = render_comparison(runs, tmp_path / "out")
    assert rendered.html == tmp_path / "out" / "comparison.html"
    page = rendered.html.read_text()
    for p, run in zip((0, 5, 10), runs, strict=True):
        assert f'<td class="text">loss {p}%</td>' in page
        final = json.loads((run / "summary.json").read_text())["final_loss"]
        assert f"<td>{final:.4f}</td>" in page
    assert len({json.loads((r / "summary.json").read_text())["final_loss"] for r in runs}) == 3
    for name in PLOT_NAMES:
        assert (tmp_path / "out" / "plots" / f"{name}.png").read_bytes().startswith(PNG)
        assert f'src="plots/{name}.png"' in page
    # The single runs' own plots are left alone.
    assert not (runs[0] / "index.html").exists()


def test_labels_are_unique_when_runs_share_a_name(tmp_path: Path):
    a = write_run(tmp_path / "a", "same", 0.0)
    b = write_run(tmp_path / "b", "same", 0.1)
    assert labels_for([load_run(a), load_run(b)]) == ["a", "b"]
    assert labels_for([load_run(a), load_run(a)]) == ["same", "same #2"]


def test_a_partial_last_line_of_a_killed_writer_is_dropped_and_said(tmp_path: Path):
    run_dir = write_run(tmp_path / "killed", "killed", 0.05, finish=False)
    path = run_dir / "events-rank1.jsonl"
    count = len(lines(path))
    fragment = b'{"type": "step", "t": 1.3, "rank": 1, "st'
    with path.open("ab") as file:
        file.write(fragment)
    run = load_run(run_dir)
    assert len(run.steps) == WORKERS * STEPS
    assert run.warnings == [f"{path}:{count + 1}: partial last line ignored "
                            f"({len(fragment)} bytes; the writer was killed mid-write?)"]
    rendered = render_run(run)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["success"] is False  # it never finished
    assert "partial last line ignored" in rendered.html.read_text()


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{not json\n", "not valid JSON: Expecting property name enclosed in double quotes"),
        (b'{"type": "step", "t": 0.1, "rank": 0, "step": 99, "loss": "low"}\n',
         "bad step event: field 'loss' must be a number, not 'low'"),
        (b'{"type": "link", "t": 0.1, "src": 0, "dst": 1, "configured_loss": 0.1}\n',
         "bad link event: field 'measured_loss' is missing"),
        (b"[1, 2]\n", "bad event: an event must be a JSON object, not list"),
        # A complete last line (it ends in a newline) was not cut short: an error too.
        (b"{truncated\n", "not valid JSON"),
    ],
)
def test_a_malformed_line_is_an_error_naming_file_and_line(run_dir: Path, line: bytes,
                                                            reason: str):
    path = run_dir / "events-rank0.jsonl"
    content = lines(path)
    at = len(content) if line == b"{truncated\n" else 4
    content.insert(at, line)
    path.write_bytes(b"".join(content))
    with pytest.raises(RunError) as caught:
        load_run(run_dir)
    assert str(caught.value).startswith(f"{path}:{at + 1}: {reason}")


def test_concurrent_threads_and_processes_write_whole_lines(tmp_path: Path):
    parent = RunWriter.create(tmp_path / "busy", clock=FakeClock())
    worker = RunWriter.open(tmp_path / "busy", rank=0)

    def steps(offset: int) -> None:
        for step in range(offset, offset + 200):
            worker.event("step", rank=0, step=step, loss=1.0, note="x" * 500)

    threads = [threading.Thread(target=steps, args=(i * 200,)) for i in range(4)]
    for thread in threads:
        thread.start()
    processes = [multiprocessing.get_context("fork").Process(
        target=_process_writer, args=(tmp_path / "busy", rank)) for rank in (1, 2)]
    for process in processes:
        process.start()
    for thread in threads:
        thread.join()
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    worker.close()
    parent.close()
    run = load_run(tmp_path / "busy")
    assert run.warnings == []
    assert [sum(s.rank == r for s in run.steps) for r in range(3)] == [800, 300, 300]
    assert {s.step for s in run.steps if s.rank == 0} == set(range(800))


def _process_writer(run_dir: Path, rank: int) -> None:
    with RunWriter.open(run_dir, rank=rank) as writer:
        for step in range(300):
            writer.event("step", rank=rank, step=step, loss=2.0)


def test_cli_renders_one_run_and_says_where_the_page_is(run_dir: Path):
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert str(run_dir / "index.html") in result.output
    assert (run_dir / "plots" / "links.png").is_file()


def test_cli_compares_runs_into_the_output_directory(tmp_path: Path):
    runs = [str(write_run(tmp_path / f"r{p}", f"loss {p}%", p / 100)) for p in (0, 10)]
    result = CliRunner().invoke(app, ["report", *runs, "-o", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert str(tmp_path / "cmp" / "comparison.html") in result.output
    assert "loss 10%" in (tmp_path / "cmp" / "comparison.html").read_text()
    default = CliRunner().invoke(app, ["report", *runs])  # beside the runs
    assert default.exit_code == 0, default.output
    assert str(tmp_path / "comparison" / "comparison.html") in default.output


def test_cli_bad_input_is_one_line_and_an_exit_code(tmp_path: Path, run_dir: Path):
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2
    assert missing.output.strip() == f"error: {tmp_path / 'nowhere'}: no such directory"
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert empty.exit_code == 2 and "no events files" in empty.output
    path = run_dir / "events-rank2.jsonl"
    content = lines(path)
    content.insert(2, b"garbage\n")
    path.write_bytes(b"".join(content))
    bad = CliRunner().invoke(app, ["report", str(run_dir)])
    assert bad.exit_code == 1
    assert bad.output.strip().splitlines() == [f"error: {path}:3: not valid JSON: Expecting "
                                               "value"]
    assert isinstance(bad.exception, SystemExit)  # a clean exit, not an uncaught error


def test_describe_runs_gives_each_runs_verdict_and_log_tails(tmp_path: Path):
    run = tmp_path / "a" / "run"
    (run / "logs").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"success": False, "error": "worker 1 died"}))
    (run / "logs" / "worker-1.log").write_text("".join(f"line {i}\n" for i in range(30)))
    (run / "logs" / "worker-1.stderr").write_text("terminate called\n")  # a command job's
    (run / "logs" / "worker-1.stdout").write_text("not shown\n")
    (tmp_path / "b" / "logs").mkdir(parents=True)

    text = describe_runs(tmp_path, log_lines=3)

    assert f"{run}: success=False error=worker 1 died" in text
    assert "--- worker-1.log (last 3 lines)\nline 27\nline 28\nline 29" in text
    assert f"{tmp_path / 'b'}: no summary.json" in text
    assert "--- worker-1.stderr (last 1 lines)\nterminate called" in text
    assert "not shown" not in text
