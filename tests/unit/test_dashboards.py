"""The Grafana dashboards (testbed/dashboards.py, grafana/): the committed JSON is what the code
generates, every panel and annotation is wired to the provisioned datasource and filtered by the
dashboard's variables, every action of the fault timeline has its annotation, and every metric a
query names is one a real `WorkerMetrics` exports, with the labels the query matches on.
tests/netns/test_dashboards_prometheus.py runs every query against a real Prometheus scraping a
real run; tests/unit/test_dashboard_schema.py checks the JSON against Grafana's schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from testbed import dashboards
from testbed.metrics.traffic import LABELS as TRAFFIC_LABELS
from testbed.metrics.traffic import TrafficCollector
from testbed.metrics.worker import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
COMMITTED = {path.name: path for path in (GRAFANA / "dashboards").glob("*.json")}
SELECTOR = re.compile(r"\b(testbed_[a-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
TARGET_LABELS = {"scenario", "run", "worker", "instance", "job"}  # added by the scrape


def exported() -> dict[str, set[str]]:
    """Every sample name a worker's /metrics can carry -> its labels, from a real registry
    (with the collector of the background flows a worker receives)."""
    metrics = WorkerMetrics(0)
    traffic = TrafficCollector(Path("/nonexistent/traffic-0.json"), 0)  # a receiver's
    metrics.registry.register(traffic)
    labels = {family.name: set(TRAFFIC_LABELS) for family in traffic.describe()}
    for collector in metrics.registry._collector_to_names:  # the registry's own bookkeeping
        if isinstance(collector, MetricWrapperBase):
            labels[collector._name] = set(collector._labelnames)
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        own = labels.get(family.name, {"rank"})  # the namespace collector: rank only
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "info": ["_info"], "gauge": [""]}[family.type]
        for suffix in suffixes:
            names[family.name + suffix] = own | ({"le"} if suffix == "_bucket" else set())
    return names


EXPORTED = exported()


def load(name: str) -> dict[str, Any]:
    return json.loads(COMMITTED[name].read_text())


def all_queries() -> list[tuple[str, str, str, list[str]]]:
    """(file, where, PromQL, its label templates) of every panel target and annotation."""
    queries = [(name, panel["title"], t["expr"], [t.get("legendFormat", "")])
               for name in sorted(COMMITTED)
               for panel in load(name)["panels"] for t in panel["targets"]]
    queries += [(name, f"annotation {a['name']}", a["expr"], [a["titleFormat"], a["textFormat"]])
                for name in sorted(COMMITTED) for a in load(name)["annotations"]["list"]]
    return queries


def test_exported_names_come_from_the_registry():
    # The collection itself could be wrong: it must know counters by _total, histograms by
    # their three series, and the labels of each.
    assert EXPORTED["testbed_steps_total"] == {"rank"}
    assert "testbed_steps" not in EXPORTED
    assert EXPORTED["testbed_step_duration_seconds_bucket"] == {"rank", "le"}
    assert "testbed_step_duration_seconds_count" in EXPORTED
    assert EXPORTED["testbed_datagrams_lost_total"] == {"rank", "peer"}
    assert EXPORTED["testbed_link_profile_info"] == {"rank", "peer", "direction"}
    assert EXPORTED["testbed_netns_tcp_retransmitted_segments_total"] == {"rank"}
    assert EXPORTED["testbed_fault_event_timestamp_seconds"] == {"rank", "action", "target"}


def test_the_committed_json_is_what_the_code_generates(tmp_path: Path):
    generated = dashboards.generated()
    assert set(COMMITTED) == set(generated), "run: testbed dashboards"
    for name, text in generated.items():
        assert COMMITTED[name].read_text() == text, f"{name} is stale: testbed dashboards"
    assert dashboards.write(check=True) == 0
    # --check notices a change, and a file no dashboard generates.
    for name, text in generated.items():
        (tmp_path / name).write_text(text)
    assert dashboards.write(tmp_path, check=True) == 0
    (tmp_path / "drift.json").write_text(generated["drift.json"].replace("drift", "drfit"))
    assert dashboards.write(tmp_path, check=True) == 1
    (tmp_path / "drift.json").write_text(generated["drift.json"])
    (tmp_path / "old.json").write_text("{}")
    assert dashboards.write(tmp_path, check=True) == 1


def test_dashboard_uids_are_fixed_and_unique():
    uids = {name: load(name)["uid"] for name in COMMITTED}
    assert uids == {"overview.json": "testbed-overview", "network.json": "testbed-network",
                    "drift.json": "testbed-drift", "stragglers.json": "testbed-stragglers",
                    "moshpit.json": "testbed-moshpit"}
    titles = [load(name)["title"] for name in COMMITTED]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_every_panel_is_wired_to_the_provisioned_datasource(name: str):
    board = load(name)
    panels = board["panels"]
    assert panels
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids {ids}"
    titles = [panel["title"] for panel in panels]
    assert len(set(titles)) == len(titles), f"{name}: duplicate titles"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        where = f"{name}: {panel['title']}"
        assert panel["datasource"]["uid"] == dashboards.DATASOURCE_UID, where
        assert panel["targets"], f"{where}: no target"
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, where
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"{where}: overlaps another panel"
        cells |= mine
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), where
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == dashboards.DATASOURCE_UID, where
            assert t["expr"].strip(), where


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_every_dashboard_has_the_variables_and_every_query_uses_them(name: str):
    board = load(name)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(dashboards.VARIABLES) <= set(variables), name
    for v in variables.values():
        assert v["datasource"]["uid"] == dashboards.DATASOURCE_UID
    # worker is the metrics' rank label, within the selected scenario and run.
    worker = variables["worker"]["definition"]
    assert worker.endswith(", rank)") and '$scenario' in worker and '$run' in worker
    assert '$scenario' in variables["run"]["definition"]
    for file, where, expr, _ in all_queries():
        if file != name:
            continue
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{name}: {where}: no testbed metric in {expr!r}"
        for metric, braces in selectors:
            matchers = {label: (op, value) for label, op, value in MATCHER.findall(braces)}
            for label, variable in (("scenario", "scenario"), ("run", "run"),
                                    ("rank", "worker")):
                assert matchers.get(label) == ("=~", f"${variable}"), (
                    f"{name}: {where}: {metric} is not filtered by ${variable}")


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_every_dashboard_marks_every_action_of_the_fault_timeline(name: str):
    from testbed.scenario.timeline import ACTIONS

    listed = load(name)["annotations"]["list"]
    assert [a["name"] for a in listed] == [spec[0] for spec in dashboards.FAULT_ANNOTATIONS]
    marked: list[str] = []
    for annotation in listed:
        where = f"{name}: annotation {annotation['name']}"
        assert annotation["datasource"]["uid"] == dashboards.DATASOURCE_UID, where
        assert annotation["enable"] and not annotation["hide"], where
        # The value is the event's time in seconds: Grafana takes it, in ms, as the time.
        assert annotation["useValueForTime"] is True, where
        assert annotation["expr"].endswith(" * 1000"), where
        assert f"{dashboards.FAULTS}{{" in annotation["expr"], where
        (actions,) = re.findall(r'action=~"([^"]*)"', annotation["expr"])
        marked += actions.split("|")
        assert "{{action}}" in annotation["titleFormat"], where
        assert "{{target}}" in annotation["titleFormat"], where
    # Each action once: the timeline's own, and a ramp's later updates.
    assert sorted(marked) == sorted([*ACTIONS, "ramp_step"])


def test_every_metric_a_query_names_is_exported_with_the_labels_it_uses():
    queried: set[str] = set()
    for name, title, expr, formats in all_queries():
        names = set()
        for metric, braces in SELECTOR.findall(expr):
            assert metric in EXPORTED, f"{name}: {title}: no worker exports {metric}"
            names.add(metric)
            for label, _, _ in MATCHER.findall(braces):
                assert label in EXPORTED[metric] | TARGET_LABELS, (
                    f"{name}: {title}: {metric} has no label {label!r}")
        available = set().union(*(EXPORTED[m] for m in names)) | TARGET_LABELS
        for group in BY.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                assert label in available, f"{name}: {title}: by ({label}) is no label"
        for legend_label in re.findall(r"\{\{(\w+)\}\}", " ".join(formats)):
            assert legend_label in available, f"{name}: {title}: legend {{{{{legend_label}}}}}"
        queried |= names
    # The dashboards cover the families that matter (a sample, not all of them).
    for metric in ("testbed_loss", "testbed_datagrams_lost_total",
                   "testbed_straggler_wait_seconds_bucket", "testbed_parameter_drift_ratio",
                   "testbed_collective_rounds_total", "testbed_link_loss_ratio",
                   "testbed_micro_batches_dropped_total",
                   "testbed_collective_tcp_retransmitted_segments_total",
                   "testbed_fault_event_timestamp_seconds"):
        assert metric in queried, f"no panel shows {metric}"


def test_the_metric_checks_catch_a_wrong_query():
    """The checks above are not vacuous: a made-up metric and a missing filter are found."""
    bad = dashboards.target('rate(testbed_steps{scenario=~"$scenario"}[5m])')
    (metric, braces), = SELECTOR.findall(bad["expr"])
    assert metric not in EXPORTED
    assert dict((k, v) for k, _, v in MATCHER.findall(braces)) == {"scenario": "$scenario"}


def test_substitute_writes_the_variables_as_grafana_does():
    expr = dashboards.rate("testbed_steps_total", "rank")
    out = dashboards.substitute(expr, {"scenario": "a.b", "run": ["r1", "r-2"],
                                       "worker": "$__all"},
                                interval=1, scrape_interval=1, range_seconds=90)
    assert out == ('sum by (rank) (rate(testbed_steps_total{scenario=~"a\\\\.b", '
                   'run=~"(r1|r-2)", rank=~".*"}[4s]))')
    assert dashboards.rate_interval(30, 2) == 32 and dashboards.rate_interval(1, 15) == 60
    assert "[120s]" in dashboards.substitute("x[$__range]", {}, interval=1, scrape_interval=1,
                                             range_seconds=120)
    with pytest.raises(ValueError, match=r"\$nope"):
        dashboards.substitute("x{a=~\"$nope\"}", {}, interval=1, scrape_interval=1,
                              range_seconds=1)


def test_the_provisioning_points_at_the_datasource_and_the_dashboards():
    datasources = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["uid"] == dashboards.DATASOURCE_UID
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "testbed.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    # The Compose project mounts grafana/dashboards there and opens overview.json first.
    compose = (ROOT / "testbed" / "compose.py")
    if compose.exists():
        text = compose.read_text()
        assert "/var/lib/grafana/dashboards/overview.json" in text
        assert "/etc/grafana/provisioning" in text
