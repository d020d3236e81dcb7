"""Competing traffic: what a collective loses to a real queue.

Four workers train the same small job (`mlp` on the digits, batch 32, SGD) over links of
100 Mbit/s, once per collective (ring, gloo, lossy; strategy gradient: an all-reduce of the
gradients every step) and per condition of the bottleneck into worker 1:

- `none`: the links alone;
- `tcp cubic`, `tcp bbr`: a TCP bulk flow (iperf3, that congestion control) from worker 2 to
  worker 1 for the whole of training;
- `udp on/off`: UDP from worker 2 to worker 1 at 50 Mbit/s, 1 s on, 1 s off;
- `udp 120 on/off`: the same at 120 Mbit/s, more than the link carries (unresponsive overload);
- `none, again`: the links alone once more, after the others: how far the baseline itself moved
  while the cells ran (the machine's other work), the noise floor of the ratios.

Every cell is one `ClusterRun` of a scenario written here, its flow in the scenario's
`traffic:` section, exactly as a user runs it (`testbed run`). The figures come from the run
directory: `allreduce_seconds` of every worker's step events (the collective's own time, the
wait for slower peers included; the steps of the first `WARMUP` seconds of training left out,
while the flow's TCP fills the queue), lossy's `coverage`, and the competing flow's throughput
from the run's `traffic` events. The collective's time is compared with the same collective's
`none` cell of the same run (side by side: the same machine, minutes apart).

The bottleneck is one queue. Every link has the same profile (`rate: 100mbit`, the default
queue limit of 1000 packets) and nothing that draws random numbers, so no link gets a rule of
its own: each receiver's switch port has one shaped htb class, the catch-all 1:1, which every
sender's packets to that receiver go through (the collective's and the flow's alike), and one
unshaped class for the testbed's own control address. While a cell runs, a sampler reads
worker 1's port (`tc -s qdisc/class` in the lab's switch namespace, from the run's `cluster`
event) every `SAMPLE_EVERY` seconds: the backlog of the catch-all's queue (as milliseconds at
100 Mbit/s), its drops, and at the end which classes carried the bytes, so the results show
that the flow and the collective met in that one queue.

    .venv/bin/python -m benchmarks.competing [--steps N] [--collectives ring,gloo,lossy]
        [--conditions none,cubic,bbr,udp,udp120,none2] [--timeout S] [--out PATH]

Writes benchmarks/results/competing.md after every cell (about 12 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import Run, partial
from benchmarks.scenario_runs import fmt, run_scenario, status_text

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "competing.md"
WORLD = 4
RATE = "100mbit"
RATE_BPS = 100e6
LIMIT = 1000  # packets: the queue limit of every link (netem's and the fallback's default)
RECEIVER, SENDER = 1, 2  # the competing flow enters the receiver that the collective reaches
STEPS = 250
WARMUP = 1.0  # seconds of training whose steps are left out
SAMPLE_EVERY = 0.2  # seconds between readings of the receiver's port
TIMEOUT = 300.0
JOB = {"model": "mlp", "batch": 32}
COLLECTIVES = ("ring", "gloo", "lossy")
TRANSPORT = {"ring": "TCP", "gloo": "TCP", "lossy": "UDP"}


@dataclass(frozen=True)
class Condition:
    name: str
    label: str
    flows: tuple[dict[str, Any], ...] = ()


CONDITIONS = {c.name: c for c in (
    Condition("none", "none"),
    Condition("cubic", "tcp cubic",
              ({"from": SENDER, "to": RECEIVER, "kind": "tcp", "congestion": "cubic"},)),
    Condition("bbr", "tcp bbr",
              ({"from": SENDER, "to": RECEIVER, "kind": "tcp", "congestion": "bbr"},)),
    Condition("udp", "udp 50M on/off",
              ({"from": SENDER, "to": RECEIVER, "kind": "udp", "rate": "50mbit",
                "on": "1s", "off": "1s"},)),
    Condition("udp120", "udp 120M on/off",
              ({"from": SENDER, "to": RECEIVER, "kind": "udp", "rate": "120mbit",
                "on": "1s", "off": "1s"},)),
    Condition("none2", "none, again"),  # the baseline once more, last: how much it moved
)}


def scenario(collective: str, condition: Condition, steps: int) -> dict[str, Any]:
    """The cell's scenario, as the YAML the runner loads."""
    return {"name": f"competing-{collective}-{condition.name}", "seed": 1, "workers": WORLD,
            "topology": {"default": {"rate": RATE, "limit": LIMIT}},
            "job": {**JOB, "steps": steps}, "collective": {"kind": collective},
            "traffic": [dict(flow) for flow in condition.flows]}


# -- the receiver's port, read while the cell runs ---------------------------------------------


@dataclass
class PortReading:
    """What the sampler saw at the receiver's switch port: the catch-all queue's backlog
    (bytes, one per reading during training), its drops and bytes at the last reading, and
    each htb class's rate and bytes then (handle -> (rate, bytes)), and how many filters
    send packets to a class other than the catch-all."""

    backlog: list[float] = field(default_factory=list)
    drops: int = 0
    classes: dict[str, tuple[str, int]] = field(default_factory=dict)
    filters: int | None = None
    readings: int = 0

    def delay_ms(self, q: float) -> float:
        """The `q` quantile of the queue's backlog, as milliseconds at the link's rate."""
        if not self.backlog:
            return math.nan
        return float(np.quantile(self.backlog, q)) * 8 / RATE_BPS * 1e3


class PortSampler:
    """Reads the receiver's port while a cell runs: finds the lab from the run directory's
    `cluster` event, waits for the `training` event, then reads `tc -s` every SAMPLE_EVERY."""

    def __init__(self, run_dir: Path, receiver: int = RECEIVER) -> None:
        self.run_dir, self.port = run_dir, f"p{receiver}"
        self.reading = PortReading()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="port sampler", daemon=True)

    def __enter__(self) -> PortSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _events(self) -> list[dict[str, Any]]:
        try:
            text = (self.run_dir / "events.jsonl").read_text()
        except OSError:
            return []
        events = []
        for line in text.splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                events.append(json.loads(line))
        return events

    def _run(self) -> None:
        switch, training = None, False
        while not self._stop.wait(SAMPLE_EVERY):
            if not training:
                events = self._events()
                switch = next((f"{e['prefix']}-sw" for e in events if e.get("type") == "cluster"
                               and e.get("prefix")), None)
                training = switch is not None and any(e.get("type") == "training"
                                                      for e in events)
                continue
            assert switch is not None
            qdiscs = _tc(switch, "qdisc", self.port)
            if qdiscs is None:
                continue  # the lab is gone (or not yet there)
            leaf = next((q for q in qdiscs if q.get("parent") == "1:1"), None)
            if leaf is None:
                continue
            self.reading.backlog.append(float(leaf.get("backlog", 0)))
            self.reading.drops = int(leaf.get("drops", 0))
            self.reading.readings += 1
            classes = parse_classes(_text(switch, "class", self.port))
            if classes:
                self.reading.classes = classes
            if self.reading.filters is None:
                self.reading.filters = _text(switch, "filter", self.port).count("flowid")


def _tc(namespace: str, what: str, device: str) -> list[dict[str, Any]] | None:
    """`tc -s -j WHAT show dev DEVICE` in `namespace`, parsed (None if it failed)."""
    try:
        return json.loads(_text(namespace, what, device, "-j")) or None
    except json.JSONDecodeError:
        return None


def _text(namespace: str, what: str, device: str, *options: str) -> str:
    """What `tc -s [OPTIONS] WHAT show dev DEVICE` prints in `namespace` ('' if it failed)."""
    try:
        result = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", *options, what,
                                 "show", "dev", device],
                                capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


_CLASS = re.compile(r"^class htb (?P<handle>\S+) .*?\brate (?P<rate>\S+) .*?\n\s*"
                    r"Sent (?P<bytes>\d+) bytes", re.M | re.S)


def parse_classes(text: str) -> dict[str, tuple[str, int]]:
    """htb classes from `tc -s class show` (htb's classes print no JSON): handle -> (rate,
    bytes sent)."""
    return {m["handle"]: (m["rate"], int(m["bytes"])) for m in _CLASS.finditer(text)}


# -- one cell -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    collective: str
    condition: str
    status: str = "skipped"
    note: str = ""
    steps: int = 0  # steps run (the slowest worker's count)
    counted: int = 0  # (worker, step) samples after the warm-up
    allreduce: list[float] = field(default_factory=list)  # seconds, the counted samples
    step_seconds: float = math.nan  # median of the counted samples
    coverage: float = math.nan  # lossy: mean over the counted samples
    coverage_min: float = math.nan
    kb_per_step: float = math.nan  # sent per worker and step
    flow_mbps: float = math.nan  # the competing flow's receive rate while it sent
    flow_bytes: float = math.nan  # what it delivered in all
    flow_lost: float = math.nan  # UDP: datagrams lost
    flow_restarts: int = 0
    wall: float = math.nan
    training: float = math.nan  # seconds of training
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average before, after
    port: PortReading = field(default_factory=PortReading)

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.allreduce, q)) if self.allreduce else math.nan


def run_cell(collective: str, condition: Condition, steps: int, timeout: float,
             workdir: Path) -> Outcome:
    """Run the cell's scenario, reading the receiver's port meanwhile; its figures."""
    name = f"{collective}-{condition.name}"
    before = os.getloadavg()[0]
    with PortSampler(workdir / name) as sampler:
        ran = run_scenario(scenario(collective, condition, steps), name, workdir, timeout)
    outcome = Outcome(collective, condition.name, ran.status, ran.note, wall=ran.wall,
                      load=(before, os.getloadavg()[0]), port=sampler.reading)
    if ran.run is not None:
        read_run(outcome, ran.run)
    return outcome


def read_run(outcome: Outcome, run: Any) -> None:
    """The outcome's figures from a loaded run (`testbed.report.load_run`)."""
    start = run.training_t
    steps = [s for s in run.steps if start is None or s.t >= start + WARMUP]
    outcome.steps = int(max((s.step for s in run.steps), default=-1)) + 1
    outcome.counted = len(steps)
    outcome.allreduce = [float(s.allreduce_seconds) for s in steps
                         if s.allreduce_seconds is not None]
    if steps:
        outcome.step_seconds = float(np.median([s.step_seconds for s in steps]))
        coverage = [s.coverage for s in steps if s.coverage is not None]
        if coverage:
            outcome.coverage, outcome.coverage_min = float(np.mean(coverage)), min(coverage)
        sent = [s.bytes_sent for s in steps if s.bytes_sent]  # gloo reports none
        if sent:
            outcome.kb_per_step = float(np.mean(sent)) / 1e3
    ends = [s.t for s in run.steps]
    if start is not None and ends:
        outcome.training = max(ends) - start
    outcome.flow_mbps, outcome.flow_bytes, outcome.flow_lost = flow_rate(run.other)
    summary = next((e for e in reversed(run.other) if e.get("type") == "cross_traffic"), None)
    if summary:
        outcome.flow_restarts = sum(int(f.get("restarts") or 0)
                                    for f in (summary.get("flows") or {}).values())


def flow_rate(events: Sequence[dict[str, Any]]) -> tuple[float, float, float]:
    """From the run's `traffic` events: the competing flows' receive rate while they sent
    (Mbit/s, all flows together, over the seconds their servers reported: an on/off flow's
    bursts), the bytes received, and for UDP the datagrams lost (NaN: none reported)."""
    reports = [e for e in events if e.get("type") == "traffic"]
    seconds = sum(float(e.get("seconds") or 0) for e in reports)
    if not seconds:
        return math.nan, math.nan, math.nan
    received = sum(float(e.get("bytes") or 0) for e in reports)
    lost = [float(e["lost"]) for e in reports if e.get("lost") is not None]
    return received * 8 / seconds / 1e6, received, (sum(lost) if lost else math.nan)


# -- the report -----------------------------------------------------------------------------------


def mean_rate(o: Outcome) -> float:
    """The competing flow's bytes over the seconds of training, in Mbit/s."""
    if not (math.isfinite(o.flow_bytes) and math.isfinite(o.training)) or o.training <= 0:
        return math.nan
    return o.flow_bytes * 8 / o.training / 1e6


def ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def ratio(value: float, baseline: float) -> float:
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline <= 0:
        return math.nan
    return value / baseline


def times(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}×"


def baseline(outcomes: Sequence[Outcome], collective: str) -> Outcome | None:
    return next((o for o in outcomes if o.collective == collective and o.condition == "none"
                 and o.allreduce), None)


def side_by_side(outcomes: Sequence[Outcome], conditions: Sequence[str],
                 q: float) -> list[str]:
    """One row per collective, one column per condition: the all-reduce time's `q` quantile
    in ms and its ratio to the same collective's `none` cell."""
    labels = [CONDITIONS[c].label for c in conditions]
    rows = ["| collective | " + " | ".join(labels) + " |",
            "|---|" + "---:|" * len(conditions)]
    for collective in dict.fromkeys(o.collective for o in outcomes):
        clean = baseline(outcomes, collective)
        cells = []
        for condition in conditions:
            o = next((o for o in outcomes if o.collective == collective
                      and o.condition == condition), None)
            if o is None or not o.allreduce:
                cells.append("-" if o is None else o.status)
                continue
            value = o.quantile(q)
            factor = ratio(value, clean.quantile(q)) if clean else math.nan
            cells.append(f"{ms(value)} ({times(factor)})" if condition != "none"
                         else ms(value))
        rows.append(f"| {collective} ({TRANSPORT.get(collective, '?')}) | "
                    + " | ".join(cells) + " |")
    return rows


def coverage_row(outcomes: Sequence[Outcome], conditions: Sequence[str]) -> list[str]:
    labels = [CONDITIONS[c].label for c in conditions]
    rows = ["| lossy coverage | " + " | ".join(labels) + " |",
            "|---|" + "---:|" * len(conditions)]
    cells = []
    for condition in conditions:
        o = next((o for o in outcomes if o.collective == "lossy" and o.condition == condition),
                 None)
        cells.append("-" if o is None or not math.isfinite(o.coverage)
                     else f"{o.coverage:.4f} (min {o.coverage_min:.3f})")
    rows.append("| mean (least step) | " + " | ".join(cells) + " |")
    return rows


def detail_table(outcomes: Sequence[Outcome]) -> list[str]:
    rows = [
        "| collective | condition | steps | samples | all-reduce median ms | p90 ms | "
        "× none median | × none p90 | step median ms | coverage | kB sent/step | "
        "flow Mbit/s | flow mean Mbit/s | flow lost datagrams | queue median ms | "
        "queue p90 ms | queue drops | training s | wall s | load before/after | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|---|",
    ]
    for o in outcomes:
        clean = baseline(outcomes, o.collective)
        median, p90 = o.quantile(0.5), o.quantile(0.9)
        lost = "-" if not math.isfinite(o.flow_lost) else f"{o.flow_lost:.0f}"
        restarts = f" ({o.flow_restarts} restarts)" if o.flow_restarts else ""
        rows.append(
            f"| {o.collective} | {CONDITIONS[o.condition].label} | {o.steps} | {o.counted} | "
            f"{ms(median)} | {ms(p90)} | "
            f"{times(ratio(median, clean.quantile(0.5))) if clean else '-'} | "
            f"{times(ratio(p90, clean.quantile(0.9))) if clean else '-'} | "
            f"{ms(o.step_seconds)} | {fmt(o.coverage, 4)} | {fmt(o.kb_per_step)} | "
            f"{fmt(o.flow_mbps)}{restarts} | {fmt(mean_rate(o))} | {lost} | "
            f"{fmt(o.port.delay_ms(0.5))} | {fmt(o.port.delay_ms(0.9))} | "
            f"{o.port.drops if o.port.readings else '-'} | {fmt(o.training)} | {fmt(o.wall)} | "
            f"{o.load[0]:.2f}/{o.load[1]:.2f} | {status_text(o)} |")
    return rows


def classes_text(outcomes: Sequence[Outcome]) -> str:
    """Which htb classes of the receiver's port carried the bytes, per cell with a flow."""
    parts = []
    for o in outcomes:
        if not CONDITIONS[o.condition].flows or not o.port.classes:
            continue
        total = sum(size for _, size in o.port.classes.values()) or 1
        shares = ", ".join(f"{handle} (rate {rate}) {size / 1e6:.1f} MB ({size / total:.1%})"
                           for handle, (rate, size) in sorted(o.port.classes.items()))
        parts.append(f"{o.collective}/{CONDITIONS[o.condition].label}: {shares}, "
                     f"{o.port.filters} source filter(s)")
    return "; ".join(parts)


def observations(outcomes: Sequence[Outcome], conditions: Sequence[str]) -> list[str]:
    """Sentences from this run's numbers."""
    lines = []
    for collective in dict.fromkeys(o.collective for o in outcomes):
        clean = baseline(outcomes, collective)
        if clean is None:
            continue
        found = [(ratio(o.quantile(0.5), clean.quantile(0.5)), o) for o in outcomes
                 if o.collective == collective and CONDITIONS[o.condition].flows and o.allreduce]
        if not found:
            continue
        worst, o = max(found, key=lambda pair: pair[0] if math.isfinite(pair[0]) else -1)
        mildest, m = min(found, key=lambda pair: pair[0] if math.isfinite(pair[0]) else 1e9)
        text = (f"- {collective}: median all-reduce {ms(clean.quantile(0.5))} ms alone "
                f"(p90 {ms(clean.quantile(0.9))}); slowest under "
                f"{CONDITIONS[o.condition].label} ({ms(o.quantile(0.5))} ms, {times(worst)}, "
                f"p90 {ms(o.quantile(0.9))} ms)")
        if m is not o:
            text += f", least slowed under {CONDITIONS[m.condition].label} ({times(mildest)})"
        lines.append(text + ".")
    lossy = [o for o in outcomes if o.collective == "lossy" and math.isfinite(o.coverage)]
    if lossy:
        lines.append("- lossy's coverage: " + ", ".join(
            f"{CONDITIONS[o.condition].label} {o.coverage:.4f}" for o in lossy)
            + " (the fraction of contributions in the result; the rest came after the "
            "deadline or was dropped at the full queue).")
    again = [(o.collective, ratio(o.quantile(0.5), clean.quantile(0.5))) for o in outcomes
             if o.condition == "none2" and (clean := baseline(outcomes, o.collective))]
    if again:
        lines.append("- The baseline run again after the other cells (the noise floor of the "
                     "ratios: the same cell, minutes apart): median " + ", ".join(
                         f"{c} {times(r)}" for c, r in again) + " of the first.")
    queued = [o for o in outcomes if CONDITIONS[o.condition].flows and o.port.backlog]
    if queued:
        lines.append("- The queue into worker 1 (median / p90 of its backlog, as ms at "
                     "100 Mbit/s): " + ", ".join(
                         f"{o.collective}/{CONDITIONS[o.condition].label} "
                         f"{fmt(o.port.delay_ms(0.5))}/{fmt(o.port.delay_ms(0.9))}"
                         for o in queued) + ".")
    flows = [o for o in outcomes if CONDITIONS[o.condition].flows
             and math.isfinite(o.flow_mbps)]
    if flows:
        lines.append("- The competing flow got (Mbit/s received while sending / over "
                     "training): " + ", ".join(
            f"{o.collective}/{CONDITIONS[o.condition].label} {fmt(o.flow_mbps)}/"
            f"{fmt(mean_rate(o))}"
            for o in flows) + ".")
    loads = [value for o in outcomes for value in o.load if math.isfinite(value)]
    if loads:
        lines.append(
            f"- Host load (1-minute average, before and after each cell) ranged "
            f"{min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} cores"
            + (": at or above the core count, other work shared the CPUs, so the absolute "
               "times carry that load; each ratio sets cells run minutes apart side by side."
               if max(loads) >= (os.cpu_count() or 1) else "."))
    return lines


def write_report(outcomes: Sequence[Outcome], conditions: Sequence[str], run: Run,
                 path: Path, total: int, steps: int) -> None:
    note = partial(len(outcomes), total)
    also = (
        f" How: every cell is one `ClusterRun` (backend auto) of a scenario written by the "
        f"benchmark: {WORLD} workers, each a process in its own network namespace on one "
        f"bridge; every link {RATE}, queue limit {LIMIT} packets "
        f"({LIMIT * 1514 * 8 / RATE_BPS * 1e3:.0f} ms of full frames at 100 Mbit/s), no delay "
        f"or loss; job `{JOB['model']}` "
        f"(4,810 parameters: 19 kB of gradient), batch {JOB['batch']}, {steps} steps, "
        f"strategy gradient, the collective's default options; TCP of the workers cubic (the "
        f"default). The competing flow is the scenario's `traffic:` section: iperf3 from worker "
        f"{SENDER} to worker {RECEIVER}, started with training and ended with the run.")
    lines = run.header("What a collective loses to a real queue: ring, gloo and lossy on a "
                       "100 Mbit/s bottleneck shared with TCP and UDP", note, also)
    lines += [
        "The bottleneck: each receiver's switch port shapes every link into it. All links "
        "here have one profile (rate only, nothing random, no timeline), so the port has a "
        "single shaped htb class, the catch-all 1:1 (100 Mbit/s, a fifo of "
        f"{LIMIT} packets), which the collective's packets to worker {RECEIVER} and the "
        "competing flow's share; the only other class is the testbed's control address "
        "(unshaped: barriers and the run's store, not part of the experiment). The sampler "
        f"read worker {RECEIVER}'s port during each cell; at the end of the cells with a flow "
        "the classes had carried: " + (classes_text(outcomes) or "-") + ".",
        "",
        "Columns: `all-reduce` is the step events' `allreduce_seconds` (every worker's, every "
        f"step after the first {WARMUP:g} s of training: `samples`), the time in the "
        "collective including the wait for slower peers; `× none` its ratio to the same "
        "collective's cell without a flow. `coverage` is lossy's mean fraction of "
        "contributions in the result (1 for ring and gloo). `flow Mbit/s` is what the "
        "competing flow's receiver reported while it sent (the run's `traffic` events: an "
        "on/off flow's bursts), `flow mean` its bytes over the training's seconds, "
        "`flow lost datagrams` what UDP's receiver counted lost. `queue` is the backlog of "
        f"worker {RECEIVER}'s catch-all queue, read every {SAMPLE_EVERY:g} s, as milliseconds "
        "of waiting at 100 Mbit/s, and "
        "its drops (cumulative, at the last reading). `load` is the host's 1-minute load "
        "average before and after the cell.",
        "",
        "## All-reduce time, median over steps (ms; × the same collective with no flow)",
        "",
        *side_by_side(outcomes, conditions, 0.5),
        "",
        "## All-reduce time, p90 over steps (ms; × the same collective with no flow)",
        "",
        *side_by_side(outcomes, conditions, 0.9),
        "",
        "## Lossy's coverage",
        "",
        *coverage_row(outcomes, conditions),
        "",
        "## Every cell",
        "",
        *detail_table(outcomes),
        "",
        "## Observations (generated from this run's numbers)",
        "",
        *observations(outcomes, conditions),
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--timeout", type=float, default=TIMEOUT)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    collectives = args.collectives.split(",")
    conditions = args.conditions.split(",")
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        parser.error(f"unknown conditions {unknown}: expected some of {list(CONDITIONS)}")
    run = Run.start("benchmarks.competing")
    cells = [(c, k) for c in collectives for k in conditions]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="competing-") as tmp:
        for collective, condition in cells:
            outcome = run_cell(collective, CONDITIONS[condition], args.steps, args.timeout,
                               Path(tmp))
            outcomes.append(outcome)
            print(f"{run.progress(len(outcomes), len(cells))} {collective} {condition}: "
                  f"{outcome.status}, all-reduce median {ms(outcome.quantile(0.5))} ms, "
                  f"p90 {ms(outcome.quantile(0.9))} ms, coverage {fmt(outcome.coverage, 4)}, "
                  f"flow {fmt(outcome.flow_mbps)} Mbit/s, queue "
                  f"{fmt(outcome.port.delay_ms(0.5))} ms", flush=True)
            write_report(outcomes, conditions, run, args.out, len(cells), args.steps)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
