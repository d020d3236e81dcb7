"""What the report's figures tell a reader, checked on synthetic runs: the drift axis starts at 0
and workers whose drift coincides are named together; every time plot spans the whole run and
marks the timeline's events (numbered lines, a key, a ramp as one event); the network figure
has its losses, traffic and step time, its rates adding up to the totals; no panel is empty; a
plot not drawn says what would draw it; the summary's names say which loss and which drop rate.
The figures are caught before they are saved: nothing here rasterises a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from test_report import FakeClock, write_run
from typer.testing import CliRunner

from testbed.cli import app
from testbed.report import RunWriter, load_run, network_plot, plots
from testbed.report.drawing import NOT_TRAINING_COLOR
from testbed.report.marks import timeline_marks

WORKERS, STEPS, TRAINING = 3, 20, 2.0  # training starts 2 s into the run, a step every 0.1 s
END = TRAINING + 0.1 * STEPS + 1.0  # the run's end, 1 s after its last step
FAULT_STEP = 8


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """Every figure a plot function makes, by its file's name, instead of its PNG."""
    made: dict[str, Figure] = {}

    def keep(figure: Figure, path: Path) -> Path:
        made[path.stem] = figure
        return path

    for module in (plots, network_plot):
        monkeypatch.setattr(module, "save", keep)
    return made


def synthetic(directory: Path, *, drift=lambda rank, step: 0.01 * step * (rank + 1),
              delay: float = 0.0, wait=lambda rank, step: 0.02) -> Path:
    """A run as the namespace runner writes one: 2 s of setup, then `STEPS` steps of every
    worker (each losing `rank + 1` datagrams and sending 1000 bytes), a link change by step and
    a ramp of three updates by time, and 1 s of shutdown after the last step."""
    clock = FakeClock()
    parent = RunWriter.create(directory, name=directory.name, clock=clock)
    parent.event("training", t=TRAINING, workers=list(range(WORKERS)))
    for step in range(STEPS):
        clock.value = parent.started + TRAINING + 0.1 * (step + 1)
        if step == FAULT_STEP:
            parent.fault("set_link", scheduled=clock.value - parent.started, index=0,
                         step=FAULT_STEP, link="0->1", set={"loss": "30%"},
                         description=f"step {FAULT_STEP}: set_link 0->1 loss=30%")
        if step in (12, 14, 16):  # one ramp: one event of the timeline, three updates
            parent.fault("ramp_link", scheduled=clock.value - parent.started, index=1,
                         link="0<->1", description="at 1.2s: ramp_link 0<->1 loss=0% -> 20%")
        for rank in range(WORKERS):
            parent.event("step", rank=rank, step=step, loss=2.0 - 0.01 * step,
                         compute_seconds=0.05, wait_seconds=wait(rank, step),
                         step_seconds=0.07, injected_delay_seconds=delay,
                         micro_batches=1, collective="lossy", bytes_sent=1000,
                         bytes_received=900, datagrams_lost=rank + 1.0)
            if step % 4 == 3:
                parent.event("drift", rank=rank, step=step, drift=drift(rank, step))
    clock.value += 1.0
    parent.finish()
    return directory


def dotted(axes) -> list[float]:
    """The x of every vertical dotted line (the timeline's marks)."""
    return [line.get_xdata()[0] for line in axes.get_lines() if line.get_linestyle() == ":"]


def legend(axes) -> list[str]:
    return [text.get_text() for text in axes.get_legend().get_texts()]


def labelled(axes, prefix: str):
    """The one series (stairs) of `axes` whose label starts with `prefix`."""
    [series] = [p for p in axes.patches if str(p.get_label()).startswith(prefix)]
    return series


def test_the_drift_axis_starts_at_zero(tmp_path: Path, figures: dict[str, Figure]):
    plots.draw_all([("run", load_run(synthetic(tmp_path / "r")))], tmp_path / "plots")
    axes = figures["drift"].axes[0]
    assert axes.get_ylim()[0] == 0
    assert [name for name in legend(axes) if name.startswith("worker")] == [
        "worker 0", "worker 1", "worker 2"]


def test_workers_whose_drift_coincides_are_named_together_and_said(
        tmp_path: Path, figures: dict[str, Figure]):
    run = load_run(synthetic(tmp_path / "clean", drift=lambda rank, step: 0.0))
    plots.draw_all([("clean", run)], tmp_path / "plots")
    axes = figures["drift"].axes[0]
    assert axes.get_ylim()[0] == 0 and axes.get_ylim()[1] > 0  # not symmetric around 0
    assert "workers 0, 1, 2 (equal)" in legend(axes)
    assert "all 3 workers equal: drift 0 throughout" in [t.get_text() for t in axes.texts]


def test_every_time_plot_spans_the_run_and_marks_the_timeline(
        tmp_path: Path, figures: dict[str, Figure]):
    run = load_run(synthetic(tmp_path / "r"))
    marks = timeline_marks(run)
    assert [(m.number, m.updates) for m in marks] == [(1, 1), (2, 3)]  # the ramp is one event
    assert marks[1].text == "at 1.2s: ramp_link 0<->1 loss=0% -> 20% (3 updates until 3.7 s)"
    plots.draw_all([("r", run)], tmp_path / "plots")
    faults = [mark.start for mark in marks]  # a line where each event took effect
    for axes in [figures["drift"].axes[0], *figures["network"].axes]:
        low, high = axes.get_xlim()
        assert low == 0 and high == pytest.approx(END * 1.01)
        assert dotted(axes) == pytest.approx(faults)
        shaded = [edge for patch in axes.patches
                  if patch.get_facecolor() == to_rgba(NOT_TRAINING_COLOR)
                  for edge in (patch.get_x(), patch.get_x() + patch.get_width())]
        assert shaded == pytest.approx([0, TRAINING, TRAINING + 0.1 * STEPS, END])
    numbers = [t.get_text() for t in figures["drift"].axes[0].texts]
    assert numbers[:2] == ["1", "2"]
    key = figures["drift"].axes[0].texts[-1].get_text()
    assert key.splitlines() == [
        "Timeline events:",
        f"1  at {faults[0]:.1f} s  step {FAULT_STEP}: set_link 0->1 loss=30%",
        f"2  at {faults[1]:.1f} s  at 1.2s: ramp_link 0<->1 loss=0% -> 20% (3 updates until "
        "3.7 s)"]
    # On the step axis of the loss plot, the link change lies at the step it was due before.
    loss = figures["loss"].axes[0]
    assert dotted(loss)[0] == FAULT_STEP


def test_the_network_figure_shows_losses_traffic_and_step_time(
        tmp_path: Path, figures: dict[str, Figure]):
    run = load_run(synthetic(tmp_path / "r"))
    plots.draw_all([("r", run)], tmp_path / "plots")
    lost, traffic, step = figures["network"].axes
    assert lost.get_ylabel().startswith("datagrams lost /s")
    assert "traffic" in traffic.get_ylabel() and "Mbit/s" in traffic.get_ylabel()
    assert step.get_ylabel().startswith("step time (s)")
    total_lost = STEPS * sum(rank + 1 for rank in range(WORKERS))
    assert f"datagrams lost: {total_lost:,} in all" in legend(lost)
    # The rates, times their bins' widths, add up to what the steps counted.
    values, edges, _ = labelled(lost, "datagrams").get_data()
    assert float(np.sum(values * np.diff(edges))) == pytest.approx(total_lost)
    values, edges, _ = labelled(traffic, "sent").get_data()
    assert float(np.sum(values * np.diff(edges))) == pytest.approx(
        WORKERS * STEPS * 1000 * 8 / 1e6)
    assert "workers 0, 1, 2 (equal)" in legend(step)  # every step took 0.07 s


def test_a_network_without_loss_says_so_rather_than_drawing_noise(
        tmp_path: Path, figures: dict[str, Figure]):
    directory = tmp_path / "clean"
    synthetic(directory)
    for path in directory.glob("events*.jsonl"):  # the same run, no datagram lost
        path.write_text(path.read_text().replace('"datagrams_lost": 1.0', '"datagrams_lost": 0')
                        .replace('"datagrams_lost": 2.0', '"datagrams_lost": 0')
                        .replace('"datagrams_lost": 3.0', '"datagrams_lost": 0'))
    plots.draw_all([("clean", load_run(directory))], tmp_path / "plots")
    lost = figures["network"].axes[0]
    assert lost.get_ylim() == (0.0, 1.0)
    assert "not a datagram lost in the whole run" in [t.get_text() for t in lost.texts]


def test_no_panel_is_empty(tmp_path: Path, figures: dict[str, Figure]):
    plots.draw_all([("r", load_run(synthetic(tmp_path / "r")))], tmp_path / "plots")
    [wait] = figures["stragglers"].axes  # no straggler delay was injected: one panel
    assert "(no step had an injected straggler delay, so it is not drawn)" in \
        figures["stragglers"].get_suptitle()
    assert wait.get_xscale() == "linear"
    plots.draw_all([("d", load_run(synthetic(tmp_path / "d", delay=0.003)))],
                   tmp_path / "plots")
    assert len(figures["stragglers"].axes) == 2


def test_a_slow_step_puts_the_waits_on_logarithmic_bins(
        tmp_path: Path, figures: dict[str, Figure]):
    slow = synthetic(tmp_path / "slow", wait=lambda rank, step: 5.0 if step == 10 else 0.02)
    plots.draw_all([("slow", load_run(slow))], tmp_path / "plots")
    axes = figures["stragglers"].axes[0]
    assert axes.get_xscale() == "log" and "logarithmic" in axes.get_xlabel()


def test_comparisons_mark_each_runs_timeline_in_its_colour(
        tmp_path: Path, figures: dict[str, Figure]):
    runs = [("a", load_run(synthetic(tmp_path / "a"))),
            ("b", load_run(write_run(tmp_path / "b", "b", 0.05)))]
    plots.draw_all(runs, tmp_path / "plots")
    drift = figures["drift"].axes[0]
    assert drift.get_ylim()[0] == 0
    assert {"timeline events (a)", "timeline events (b)"} <= set(legend(drift))
    assert drift.get_xlim()[1] == pytest.approx(END * 1.01)  # the longer run's end
    key = drift.texts[-1].get_text()
    assert "a: 1  at" in key and "b: 1  at 0.7 s  set 0<->1 loss=10%" in key


def test_the_page_names_its_figures_and_says_what_draws_a_missing_plot(tmp_path: Path):
    run_dir = synthetic(tmp_path / "r")
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    page = (run_dir / "index.html").read_text()
    assert "<th>final training loss</th>" in page and "<th>DropCompute drop rate</th>" in page
    assert "<th>final loss</th>" not in page and "<th>drop rate</th>" not in page
    assert "<code>metrics.probe_links: true</code>" in page  # what draws the per-link plot
    assert '<th>#</th><th>t (s)</th>' in page  # the Faults table numbers as the plots do
    assert page.count("<tr><td>2</td>") == 3  # the ramp's three updates, one event
    assert "links.png not drawn: no link measurements; `metrics.probe_links: true`" in \
        result.output


def test_tcp_retransmits_become_increases_per_step_a_restart_counting_again(tmp_path: Path):
    parent = RunWriter.create(tmp_path / "ring", clock=FakeClock())
    for step, count in enumerate((0, 2, 5, 1, 3)):  # the worker restarted before step 3
        parent.event("step", t=0.1 * (step + 1), rank=0, step=step, loss=1.0,
                     tcp_retransmits=count)
    parent.finish()
    run = load_run(tmp_path / "ring")
    assert list(network_plot.since_previous(run, "tcp_retransmits")) == [0, 2, 3, 1, 2]
