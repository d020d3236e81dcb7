"""Compressed collectives in the places a user meets them: as a DDP communication hook (the
hook adapter unchanged), over gloo (torch.distributed point-to-point for the exchanges), and
in the metrics a worker exports."""

from __future__ import annotations

import pytest
import torch
from loopback import free_ports, spawn
from test_collectives_hook import WORLD, gradients

from testbed.collectives import create
from testbed.collectives.base import AllReduceStats
from testbed.collectives.compression import wrap
from testbed.metrics import WorkerMetrics

COMPRESSORS = {
    "arc_topk": {"density": 1.0, "momentum": 1.0, "block": 16},  # everything: exact
    "int8": {"group_size": 64},
    "int4": {"group_size": 32},
}


@pytest.fixture(scope="module")
def plain() -> dict[int, list[torch.Tensor]]:
    return gradients(None)


@pytest.mark.parametrize(("kind", "tolerance"), [("arc_topk", 1e-5), ("int8", 0.02),
                                                 ("int4", 0.2)])
def test_a_compressed_ring_works_as_a_ddp_hook(kind, tolerance, plain):
    hooked = gradients("ring", kind, **COMPRESSORS[kind])
    for rank in range(WORLD):
        for ours, theirs in zip(hooked[rank], plain[rank], strict=True):
            error = torch.linalg.vector_norm(ours - theirs) / torch.linalg.vector_norm(theirs)
            assert error <= tolerance, (kind, float(error))
    for ours, other in zip(hooked[0], hooked[1], strict=True):
        assert torch.equal(ours, other), "every rank steps on the same gradients"


def gloo_worker(rank: int, ports: list[int], results) -> None:
    torch.set_num_threads(1)
    data = torch.randn(20_001, generator=torch.Generator().manual_seed(rank))
    gloo = create("gloo", rank, WORLD, master=("127.0.0.1", ports[0]), timeout=30)
    out = {}
    try:
        for kind, params in (("int8", {}), ("int4", {}), ("topk", {"density": 0.05}),
                             ("arc_topk", {"density": 0.05, "block": 32}),
                             ("randk", {"density": 0.05}), ("powersgd", {"rank": 4})):
            compressed = wrap(gloo, kind, dense_tail=1, **params)
            if kind in ("topk", "arc_topk", "randk"):  # EF21M's first call: sent whole
                compressed.allreduce(torch.zeros_like(data), 0)
            result, stats = compressed.allreduce(data, 1)
            out[kind] = (result.numpy(), stats.extra["compression_ratio"], stats.bytes_sent)
            compressed.compressor.close()  # the gloo group stays for the next
        results.put((rank, out))
    finally:
        gloo.close()


def test_every_compressor_works_over_gloo():
    collected = dict(spawn(gloo_worker, WORLD, free_ports(1)))
    inputs = [torch.randn(20_001, generator=torch.Generator().manual_seed(r))
              for r in range(WORLD)]
    expected = torch.stack(inputs).mean(0)
    for kind, bound in (("int8", 0.02), ("int4", 0.3)):
        for rank in range(WORLD):
            result = torch.from_numpy(collected[rank][kind][0])
            error = torch.linalg.vector_norm(result - expected) / torch.linalg.vector_norm(
                expected)
            assert error < bound, (kind, float(error))
    for kind in ("topk", "arc_topk", "randk", "powersgd", "int8", "int4"):
        results = [torch.from_numpy(collected[rank][kind][0]) for rank in range(WORLD)]
        assert torch.equal(results[0], results[1]), f"{kind}: copies differ over gloo"
        assert results[0][-1] == pytest.approx(float(expected[-1]), rel=1e-5), "exact tail"
        assert 0 < collected[0][kind][1] < 0.5
    # k = 5% of the 20,000-value body; world 2: the all-gather is one shift.
    assert collected[0]["topk"][2] == 8 * 1000 + 4, "one payload of k pairs and the tail"


def test_compression_figures_become_metrics():
    metrics = WorkerMetrics(0, namespace_proc=False)
    stats = AllReduceStats("ring+arc_topk", 3, seconds=0.1, bytes_sent=1000, extra={
        "compression_ratio": 0.02, "compressed_bytes": 800.0, "compression_error": 0.4,
        "feedback_residual": 1.5, "inner_calls": 2.0, "tcp_retransmits": 0.0})
    metrics.record_collective(stats)
    metrics.record_collective(stats)
    value = metrics.registry.get_sample_value
    labels = {"rank": "0", "collective": "ring+arc_topk"}
    assert value("testbed_compression_ratio", labels) == 0.02
    assert value("testbed_compressed_bytes_total", labels) == 1600
    assert value("testbed_compression_error_ratio", labels) == 0.4
    assert value("testbed_compression_feedback_residual", labels) == 1.5
    assert value("testbed_collective_figure", {**labels, "figure": "inner_calls"}) == 2.0
