"""Every query of every Grafana dashboard, run by a real Prometheus against real runs.

A Prometheus server (Debian's /usr/bin/prometheus) scrapes every 1 s the workers of three short
`ClusterRun`s through their relays, found with `file_sd_configs` on each run's
`prometheus-targets.json`, as docs/grafana.md tells a user to. Between them the runs feed every
metric a panel shows:

- lossy: the lossy all-reduce with 20% loss between workers 0 and 1, 10% from step 10 on
  (lost datagrams, chunks missing, drift, a link change; more loss would now and then stall
  the resync's TCP beyond its time limit), a TCP resync every 3 steps, worker 3 a 300 ms
  straggler whom the others wait for only 100 ms (`straggler_timeout`: late datagrams,
  straggler wait) with DropCompute at 50 ms (drops), a straggler burst on worker 1 at step 15,
  evaluations every 10 steps (eval loss, accuracy);
- moshpit: Moshpit averaging with worker 3 killed at step 60 and restarted at step 65 (rounds,
  incomplete rounds, calls without a peer, a rejoin). The Rejoins panel counts resets of the
  step counter, so Prometheus must have scraped worker 3 before the kill: it finds a run's
  targets up to ~7 s after the file appears (its discovery hands targets to the scrapes at
  most every 5 s, the file is reread every 1 s, a scrape every 1 s), and every step takes at
  least 150 ms (the job's straggler delay), so the kill comes 9 s or more after the first
  step. (At step 25, once the zygote was warm from the run before, the kill came at 5.2 s and
  worker 3's first scrape at 5.7 s, after it.)
- ring: the ring all-reduce over links with 3% loss (its own sockets' retransmits), beside two
  background flows into worker 3 (TCP bulk, and on/off UDP whose datagrams the loss takes).
  Not more loss, and a receive limit of 120 s, not 30: on a lossy link TCP's timestamps take
  the time a loss took to mend as round-trip time, its retransmission timeout grows to 3 s and
  doubles with each retransmission lost; at 10% a segment lost 4 times (~0.19^4 a loss, some
  hundreds of losses a run) stalled a ring step past 30 s in CI. At 3% (~0.06 a round trip)
  passing 120 s takes 6 in a row from 3 s: ~5e-8 a loss, ~90 losses a run. Lost packets
  still come in thousands of segments and ~430 datagrams a burst. Every step takes at least
  30 ms (the job's straggler delay), so the 250 steps span 7.5 s or more and Prometheus
  scrapes the counters rising (a ring step alone takes ~37 ms here: 30 took 1.1 s, too short
  for a rate over 1 s scrapes).

Each run waits, while its workers linger after their last step, until Prometheus has scraped
every worker after all were done (polling its HTTP API, bounded). Then each panel target's
expression, with Grafana's variables substituted (`testbed.dashboards.substitute`: all three
scenarios and runs, every worker the `worker` variable's own query returns), goes through
`/api/v1/query_range` over the three runs and must return data; the panels that show a fault
must also show a positive value somewhere. Every annotation's expression, substituted the same
way at the annotation's own step, is turned into events as Grafana's Prometheus datasource
does, and must give exactly the runs' faults (their `events.jsonl`), each at the time the run
recorded for it. Loss comes from the fallback (nftables), so this runs on the host kernel."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from live import wait_for

from testbed import dashboards
from testbed.cluster.runner import PROMETHEUS_TARGETS, ClusterRun, WorkerState
from testbed.cluster.worker import fault_target
from testbed.report import load_run

pytestmark = pytest.mark.netns
WORLD = 4
SCRAPE = 1.0  # seconds: Prometheus' scrape interval, and the query step ($__interval)
READY_TIMEOUT = 30.0
SCRAPED_TIMEOUT = 30.0  # well inside the workers' linger (60 s)
RUN_TIMEOUT = 300.0
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
GRAFANA = Path(__file__).resolve().parents[2] / "grafana" / "dashboards"

LOSSY = """
name: dash-lossy
seed: 3
workers:
  count: 4
  overrides:
    - {worker: 3, straggler: {fixed: 300ms}}
topology:
  default: {loss: 0%}
  links:
    - between: [0, 1]
      profile: {loss: 20%}
job: {model: mlp, steps: 30, batch: 32, micro_batches: 2, strategy: sharded, eval_every: 10,
      drop_compute: {threshold: 50ms}}
# The resync crosses link 0-1 over TCP, whose retransmission timeout grows and doubles at 20%
# loss each way (a ring of four, every link so: 4 of 23 calls over 30 s, ring-stalls.md):
# 120 s, not the default 30; the resync's few messages a step are what makes 20% bearable.
collective: {kind: lossy, deadline_initial: 0.05, deadline_floor: 0.05, deadline_ceiling: 0.05,
             straggler_timeout: 0.1, resync_every: 3, timeout: 120}
metrics: {drift_every: 2, linger: 60s}  # not 3: a resync (every 3rd step) evens the copies
timeline:
  - {step: 10, set_link: {link: {between: [0, 1]}, profile: {loss: 10%}}}
  - {step: 15, straggler_burst: {workers: [1], delay: {fixed: 100ms}, steps: 3}}
"""
MOSHPIT = """
name: dash-moshpit
seed: 5
workers: 4
job: {model: mlp, steps: 120, batch: 32, strategy: average, average_every: 2,
      straggler: {fixed: 150ms}}
collective: {kind: moshpit, group_size: 2, timeout: 1.0, heartbeat: 0.2}
metrics: {drift_every: 0, linger: 60s}
timeline:
  - {step: 60, kill: 3}
  - {step: 65, restart: 3}
"""
RING = """
name: dash-ring
seed: 11
workers: 4
topology: {default: {loss: 3%}}
job: {model: mlp, steps: 250, batch: 32, strategy: gradient, straggler: {fixed: 30ms}}
collective: {kind: ring, timeout: 120}
metrics: {drift_every: 0, linger: 60s}
traffic:
  - {from: 2, to: 3, kind: tcp}
  - {from: 0, to: 3, kind: udp, rate: 5mbit, on: 1s, off: 500ms}
"""
SCENARIOS = {"lossy": (LOSSY, 30), "moshpit": (MOSHPIT, 120), "ring": (RING, 250)}
# The faults of those runs, as the annotations title them: run -> action and target.
FAULTS = {"lossy": {"set_link 0<->1", "straggler_burst 1"},
          "moshpit": {"kill 3", "restart 3"}, "ring": set()}

# Panels that show a fault of these runs: somewhere in the runs their query is above 0.
POSITIVE = {
    ("overview.json", "Training loss", "A"),
    ("overview.json", "Held-out accuracy", "A"),
    ("network.json", "Configured loss per link", "A"),
    ("network.json", "Measured loss per link", "A"),
    ("network.json", "Datagrams lost", "A"),
    ("network.json", "Datagrams late", "A"),
    ("network.json", "Chunks missing at the deadline", "A"),
    ("network.json", "TCP retransmits per socket", "A"),
    ("drift.json", "Relative drift per worker", "A"),
    ("stragglers.json", "Straggler wait", "A"),
    ("stragglers.json", "Straggler wait per worker", "B"),
    ("stragglers.json", "DropCompute drop rate", "A"),
    ("moshpit.json", "Averaging rounds", "A"),
    ("moshpit.json", "Incomplete rounds", "A"),
    ("moshpit.json", "Calls without a peer", "A"),
    ("moshpit.json", "Rejoins", "A"),
    ("network.json", "Background flows", "A"),
    ("network.json", "Background flows sending", "A"),
    ("network.json", "Background flows sending", "B"),  # ~430 datagrams a burst, 3% lost
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Prometheus:
    url: str
    log: Path

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.get("/api/v1/query", **params)["result"]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """A Prometheus scraping the runs' file_sd documents (tmp_path/runs/NAME/...), every 1 s;
    stopped at the end, pass or fail."""
    if not Path(PROMETHEUS).exists():
        pytest.fail(f"{PROMETHEUS} is missing: scripts/bootstrap.sh installs Debian's "
                    f"prometheus package", pytrace=False)
    files = [str(tmp_path / "runs" / name / PROMETHEUS_TARGETS) for name in SCENARIOS]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE:g}s", "scrape_timeout": f"{SCRAPE:g}s",
                   "evaluation_interval": f"{SCRAPE:g}s"},
        "scrape_configs": [{"job_name": "testbed", "file_sd_configs": [
            {"files": files, "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Prometheus(f"http://127.0.0.1:{port}", log)

    def readiness() -> int:
        assert process.poll() is None, f"prometheus exited:\n{server.log_tail()}"
        with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
            return response.status

    try:
        wait_for("prometheus ready", readiness, lambda status: status == 200, READY_TIMEOUT,
                 every=0.2, log=server.log_tail)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Scraped:
    """The run's `on_update`: once every worker lingers after its last step, waits until
    Prometheus has scraped all of them since, with the last step's values (so nothing of the
    run is missing from its TSDB), and notes when."""

    prometheus: Prometheus
    run: str
    steps: int
    at: float | None = None

    def __call__(self, workers: list[WorkerState]) -> None:
        if self.at is not None or not all(w.lingering for w in workers):
            return
        done = time.time()
        selector = f'testbed_step{{run="{self.run}"}}'

        def scraped() -> dict[str, Any]:
            """Each rank's last step, how many ranks were scraped since the end, up or not."""
            steps = self.prometheus.query(selector)
            stamps = self.prometheus.query(f"timestamp({selector})")
            up = self.prometheus.query(f'up{{run="{self.run}"}}')
            return {"steps": [(s["metric"]["rank"], float(s["value"][1])) for s in steps],
                    "fresh": sum(float(s["value"][1]) > done for s in stamps),
                    "up": [s["value"][1] for s in up]}

        def complete(found: dict[str, Any]) -> bool:
            return (len(found["steps"]) == WORLD and found["fresh"] == WORLD
                    and all(step == self.steps - 1 for _, step in found["steps"])
                    and len(found["up"]) == WORLD and all(up == "1" for up in found["up"]))

        wait_for(f"{self.run}: Prometheus to scrape every worker's last step after the end",
                 scraped, complete, SCRAPED_TIMEOUT, every=0.2, log=self.prometheus.log_tail)
        self.at = time.time()


def run_scenario(tmp_path: Path, prometheus: Prometheus, name: str) -> tuple[float, float]:
    """Run one scenario to its end while Prometheus scrapes it; (start, all scraped) times."""
    text, steps = SCENARIOS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    run_dir = tmp_path / "runs" / name
    started = time.time()
    cluster = ClusterRun(path, run_dir=run_dir, backend="fallback")
    scraped = Scraped(prometheus, run_dir.name, steps)
    with pytest.MonkeyPatch.context() as patch:
        # A zygote of its own, started cold as a lone `testbed run`'s is: the faults' steps
        # assume the workers start seconds after the run's targets file appears. With the
        # zygote warm from an earlier test the lossy run's link change came 2.5 s into the
        # run, before Prometheus' discovery (up to ~7 s) had it scraped.
        patch.setenv("TESTBED_DASHBOARDS_RUN", name)
        result = cluster.run(scraped, timeout=RUN_TIMEOUT)
    assert result.success, result.error
    targets = json.loads((run_dir / PROMETHEUS_TARGETS).read_text())
    assert [t["labels"]["worker"] for t in targets] == [str(r) for r in range(WORLD)]
    assert {t["labels"]["run"] for t in targets} == {name}
    assert scraped.at is not None, f"{name}: the workers were never all done while serving"
    return started, scraped.at


def label_values(prometheus: Prometheus, definition: str, values: dict[str, Any],
                 start: float, end: float) -> list[str]:
    """A `label_values(selector, label)` variable query, as Grafana runs it."""
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    assert match, definition
    selector = dashboards.substitute(match.group(1), values, interval=SCRAPE,
                                     scrape_interval=SCRAPE, range_seconds=end - start)
    return prometheus.get(f"/api/v1/label/{match.group(2)}/values", **{
        "match[]": selector, "start": f"{start:.3f}", "end": f"{end:.3f}"})


@dataclass(frozen=True, order=True)
class Annotation:
    """One event an annotation query gives: title and text as Grafana renders them, and when
    (ms since the epoch; `end` > `time` for points merged into a region)."""

    title: str
    text: str
    time: int
    end: int


def render_format(template: str, labels: dict[str, str]) -> str:
    """Grafana's renderLegendFormat: `{{label}}` becomes the label's value (its name if none)."""
    return re.sub(r"\{\{\s*(.+?)\s*\}\}", lambda m: labels.get(m.group(1)) or m.group(1),
                  template)


def annotation_events(prometheus: Prometheus, annotation: dict[str, Any],
                      values: dict[str, Any], start: float, end: float) -> list[Annotation]:
    """Run an annotation query as Grafana 11's Prometheus datasource does (a range query at
    the annotation's `step`, its variables substituted), and make its events as the
    datasource's processAnnotationResponse does: with `useValueForTime` every point of a series
    is active at the time its value says (ms), and points of one series no further apart than
    the step make one event (a region from the first to the last)."""
    assert annotation["useValueForTime"] is True
    step = float(annotation["step"].removesuffix("s"))
    expr = dashboards.substitute(annotation["expr"], values, interval=step,
                                 scrape_interval=SCRAPE, range_seconds=end - start)
    assert "$" not in expr, expr
    result = prometheus.get("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                            end=f"{end:.3f}", step=f"{step:g}")["result"]
    events: list[Annotation] = []
    for series in result:
        labels = series["metric"]
        title = render_format(annotation["titleFormat"], labels)
        text = render_format(annotation["textFormat"], labels)
        stamps = [math.floor(float(value)) for _, value in series["values"]]
        first = last = stamps[0]
        for stamp in stamps[1:]:
            if last + step * 1000 >= stamp:
                last = stamp
                continue
            events.append(Annotation(title, text, first, last))
            first = last = stamp
        events.append(Annotation(title, text, first, last))
    return events


def recorded_faults(tmp_path: Path) -> list[Annotation]:
    """The faults the runs recorded in events.jsonl, as the annotations should show them: at
    the run's start plus the fault's `t` (what the workers were told)."""
    faults = []
    for name in SCENARIOS:
        run = load_run(tmp_path / "runs" / name)
        assert run.started is not None
        for fault in run.faults:
            assert "error" not in fault.fields, f"{name}: {fault}"
            when = math.floor((run.started + fault.t) * 1000)
            faults.append(Annotation(f"{fault.action} {fault_target(fault.fields)}",
                                     f"dash-{name}, run {name}", when, when))
    return faults


def maximum(result: list[dict[str, Any]]) -> float:
    finite = [float(v) for series in result for _, v in series["values"]
              if math.isfinite(float(v))]
    return max(finite, default=-math.inf)


def test_every_dashboard_query_returns_data_from_real_runs(tmp_path: Path,
                                                           prometheus: Prometheus):
    spans = [run_scenario(tmp_path, prometheus, name) for name in SCENARIOS]
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    boards = {path.name: json.loads(path.read_text()) for path in sorted(GRAFANA.glob("*.json"))}
    assert len(boards) == 5

    # The variables, by their own queries: each offers what the runs were.
    values: dict[str, Any] = {}
    expected = {"scenario": {f"dash-{name}" for name in SCENARIOS}, "run": set(SCENARIOS),
                "worker": {str(rank) for rank in range(WORLD)}}
    for board in boards.values():
        chosen: dict[str, Any] = {}
        for variable in board["templating"]["list"]:
            offered = label_values(prometheus, variable["definition"], chosen, start, end)
            assert set(offered) == expected[variable["name"]], (variable["name"], offered)
            chosen[variable["name"]] = sorted(offered)
        values = chosen

    # Every target of every panel, as Grafana would send it.
    empty, not_positive, checked = [], [], 0
    for file, board in boards.items():
        for panel in board["panels"]:
            for t in panel["targets"]:
                expr = dashboards.substitute(t["expr"], values, interval=SCRAPE,
                                             scrape_interval=SCRAPE, range_seconds=end - start)
                assert "$" not in expr, expr
                result = prometheus.get("/api/v1/query_range", query=expr,
                                        start=f"{start:.3f}", end=f"{end:.3f}",
                                        step=f"{SCRAPE:g}")["result"]
                checked += 1
                where = f"{file}: {panel['title']} [{t['refId']}]: {expr}"
                if not result or not any(series["values"] for series in result):
                    empty.append(where)
                elif (file, panel["title"], t["refId"]) in POSITIVE and maximum(result) <= 0:
                    not_positive.append(f"{where} (max {maximum(result)})")
    assert checked == sum(len(p["targets"]) for b in boards.values() for p in b["panels"])
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not not_positive, "panels that never showed the fault:\n" + "\n".join(not_positive)
    for file, title, ref in POSITIVE:  # the list names panels that exist
        assert any(p["title"] == title and any(t["refId"] == ref for t in p["targets"])
                   for p in boards[file]["panels"]), (file, title, ref)

    # The filters select: one run's panel shows that run only, one worker's that worker only.
    only = {**values, "run": ["moshpit"], "worker": ["2"]}
    expr = dashboards.substitute(dashboards.sel("testbed_step"), only, interval=SCRAPE,
                                 scrape_interval=SCRAPE, range_seconds=end - start)
    result = prometheus.get("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                            end=f"{end:.3f}", step=f"{SCRAPE:g}")["result"]
    assert [(s["metric"]["run"], s["metric"]["rank"], s["metric"]["worker"])
            for s in result] == [("moshpit", "2", "2")]
    assert max(float(v) for _, v in result[0]["values"]) == SCENARIOS["moshpit"][1] - 1

    # Every annotation marks exactly the runs' faults of its actions, where they happened.
    faults = recorded_faults(tmp_path)
    assert {(f.text, f.title) for f in faults} == {
        (f"dash-{run}, run {run}", title) for run, titles in FAULTS.items() for title in titles}
    for file, board in boards.items():
        for annotation in board["annotations"]["list"]:
            where = f"{file}: annotation {annotation['name']}"
            actions = re.search(r'action=~"([^"]*)"', annotation["expr"]).group(1).split("|")
            wanted = sorted(f for f in faults if f.title.split()[0] in actions)
            assert wanted, f"{where}: no run has such a fault"
            events = sorted(annotation_events(prometheus, annotation, values, start, end))
            assert [(e.title, e.text) for e in events] == [(f.title, f.text) for f in wanted], (
                where, events, wanted)
            for event, fault in zip(events, wanted, strict=True):
                assert abs(event.time - fault.time) <= 1 and event.end == event.time, (
                    where, event, fault)
    # Filtered like the panels: the moshpit run's worker 3, who exports its own kill once it
    # is back (the runner told every worker, and a restarted one reads what it missed).
    (kills,) = [a for a in boards["moshpit.json"]["annotations"]["list"]
                if a["name"] == "Kills and restarts"]
    alone = annotation_events(prometheus, kills, {**values, "run": ["moshpit"], "worker": ["3"]},
                              start, end)
    assert sorted(e.title for e in alone) == ["kill 3", "restart 3"]
