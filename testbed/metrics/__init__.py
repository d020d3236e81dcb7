"""Prometheus metrics of a training worker, exported on its own /metrics endpoint
(docs/metrics.md lists every metric), and parameter drift from a shared random projection."""

from testbed.metrics.drift import (
    DEFAULT_K,
    Drift,
    drift_from,
    gather_over,
    projection,
    reference_from_shards,
)
from testbed.metrics.namespace import PREFIX, NamespaceCollector
from testbed.metrics.worker import DURATION_BUCKETS, WorkerMetrics, peer_label, straggler_wait

__all__ = [
    "DEFAULT_K",
    "DURATION_BUCKETS",
    "PREFIX",
    "Drift",
    "NamespaceCollector",
    "WorkerMetrics",
    "drift_from",
    "gather_over",
    "peer_label",
    "projection",
    "reference_from_shards",
    "straggler_wait",
]
