"""Prometheus metrics of a training worker, exported on its own /metrics endpoint
(docs/metrics.md lists every metric), and parameter drift from a shared random projection.

The names are loaded on first use: the runner reads `testbed.metrics.traffic` and
`testbed.metrics.namespace`, which need no torch, and importing torch for nothing costs it
seconds (10 s in the guest, where the zygote imports torch once more for the workers)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testbed.metrics.drift import (
        DEFAULT_K,
        Drift,
        drift_from,
        gather_over,
        projection,
        reference_from_shards,
    )
    from testbed.metrics.namespace import PREFIX, NamespaceCollector
    from testbed.metrics.worker import (
        DURATION_BUCKETS,
        WorkerMetrics,
        peer_label,
        straggler_wait,
    )

_WHERE = {
    "DEFAULT_K": "drift", "Drift": "drift", "drift_from": "drift", "gather_over": "drift",
    "projection": "drift", "reference_from_shards": "drift",
    "PREFIX": "namespace", "NamespaceCollector": "namespace",
    "DURATION_BUCKETS": "worker", "WorkerMetrics": "worker", "peer_label": "worker",
    "straggler_wait": "worker",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
