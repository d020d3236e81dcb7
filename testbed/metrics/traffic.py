"""The background flows' figures (`testbed.cluster.traffic`), exported by the worker they flow
into: whoever runs a flow's receiving end writes what it received to a status file per worker
(`status_path`, replaced whole at every report, so a reader never sees half of one), and the
worker's collector reads it at scrape time. So the figures are live whatever the job does
between its steps, and they are the same whether the runner (namespaces) or the worker's own
node (Compose) runs the flow."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from testbed.metrics.namespace import PREFIX

LABELS = ["rank", "peer", "flow", "kind"]


def status_path(run_dir: str | Path, rank: int) -> Path:
    """Where the flows into worker `rank` are reported."""
    return Path(run_dir) / "logs" / f"traffic-{rank}.json"


def write_status(path: Path, flows: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace `path` with `flows` (name -> {peer, kind, received_bytes, lost_datagrams,
    active}) in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"flows": dict(flows)}))
    os.replace(partial, path)


def read_status(path: Path) -> dict[str, dict[str, Any]]:
    """The flows `path` reports (none where it is missing or unreadable)."""
    try:
        return dict(json.loads(path.read_text())["flows"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class TrafficCollector(Collector):
    """The flows into one worker, from its status file, at scrape time."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, str(rank)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        received, lost, active = self._families()
        for name, flow in sorted(read_status(self.path).items()):
            labels = [self.rank, str(flow["peer"]), name, str(flow["kind"])]
            received.add_metric(labels, float(flow["received_bytes"]))
            active.add_metric(labels, 1.0 if flow["active"] else 0.0)
            if flow["kind"] == "udp":
                lost.add_metric(labels, float(flow["lost_datagrams"]))
        yield from (received, lost, active)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(PREFIX + "traffic_received_bytes",
                                "Bytes of a background flow (scenario traffic) this worker "
                                "received from peer", labels=LABELS),
            CounterMetricFamily(PREFIX + "traffic_lost_datagrams",
                                "Datagrams of a UDP background flow that never arrived (gaps "
                                "in iperf3's sequence numbers)", labels=LABELS),
            GaugeMetricFamily(PREFIX + "traffic_active",
                              "1 while a background flow into this worker is sending, else 0",
                              labels=LABELS),
        )
