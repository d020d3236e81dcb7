"""Compressed collectives: a layer over any collective that keeps its contract, like a DDP
communication hook over a process group (docs/compression.md).

    from testbed.collectives.compression import wrap
    compressed = wrap(create("ring", rank, world, addresses=...), "arc_topk", density=0.01)

Sparsifiers (Top-K, Rand-K, ARC-Top-K) with EF21M error feedback, group-wise INT8/INT4
quantized two-step all-reduce, PowerSGD. Their kinds and parameters are declared in
`testbed.collectives.registry.COMPRESSORS`.
"""

from __future__ import annotations

from testbed.collectives.compression.compressed import Compressed, make_compressor, wrap

__all__ = ["Compressed", "make_compressor", "wrap"]
