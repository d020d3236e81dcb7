"""`Compressed(inner, compressor)`: compression as a layer over any collective, the way a DDP
communication hook wraps a process group. It keeps the collective contract
(`allreduce(tensor, step) -> (tensor, AllReduceStats)`), so jobs, benchmarks and
`hook.comm_hook` use it unchanged.

One call cuts the flat tensor into a body, which the compressor reduces (through the inner
collective's `allreduce`, and for some compressors its reliable neighbour exchange, see
`exchange.py`), and an exact tail of `dense_tail` values that rides along uncompressed (the
training job's micro-batch count, which `dropcompute.unpack` divides by). Its stats add up
every inner call and exchange; `extra` carries the inner's figures of the call that moved the
values plus `compression_ratio` (payload bytes / fp32 bytes), `compressed_bytes` (payload
bytes of this worker's contribution), `compression_error` (||C(x) - x|| / ||x|| of what this
worker compressed) and, with EF21M, `feedback_residual` (||v_i - g_i||).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from testbed.collectives.base import AllReduceStats, CollectiveBase
from testbed.collectives.capabilities import Capabilities
from testbed.collectives.compression import quantize as q
from testbed.collectives.compression.exchange import Shift, all_gather, mesh_shift
from testbed.collectives.compression.powersgd import PowerSGD
from testbed.collectives.compression.sparsify import ARCTopK, RandK, TopK
from testbed.collectives.registry import COMPRESSORS, compressor_kind
from testbed.transport.staging import Staged


class Call:
    """One compressed all-reduce's access to the inner collective, adding up what it cost."""

    def __init__(self, inner: CollectiveBase, shift: Shift | None, step: int) -> None:
        self.inner, self.shift, self.step = inner, shift, step
        self.stats: list[AllReduceStats] = []
        self._shift_before = (shift.bytes_sent, shift.bytes_received) if shift else (0, 0)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inner collective's mean of `tensor` (fp32)."""
        result, stats = self.inner.allreduce(tensor.to(torch.float32).contiguous(), self.step)
        self.stats.append(stats)
        return result.reshape(-1)

    def all_gather(self, payload: torch.Tensor) -> list[torch.Tensor]:
        assert self.shift is not None
        return all_gather(self.shift, payload, self.step)

    def agree(self, sketch: torch.Tensor) -> torch.Tensor:
        """The sum of the workers' `sketch`es, bitwise the same on every worker: the inner's
        all-reduce where it is exact (ring, gloo), else an all-gather over its reliable
        transport summed in rank order (lossy: a lost datagram must not split the pattern)."""
        if self.inner.capabilities.exact or self.inner.world == 1:
            return self.allreduce(sketch) * self.inner.world
        if self.shift is None:
            raise ValueError(f"compressor: {self.inner.name!r} has no reliable exchange to "
                             "agree on a pattern")
        total = torch.zeros(sketch.numel(), dtype=torch.float32)
        for data in self.all_gather(sketch.to(torch.float32).contiguous().view(torch.uint8)):
            total += data.clone().view(torch.float32)
        return total

    def exact_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The exact mean of `tensor` over the workers (for resyncs): the inner's all-reduce
        if exact, else a ring all-reduce of fp32 over the reliable exchange."""
        if self.inner.capabilities.exact or self.shift is None:
            return self.allreduce(tensor)
        return ring_allreduce(self.shift, tensor, self.step, None)[0]

    def bytes(self) -> tuple[int, int]:
        sent = sum(s.bytes_sent for s in self.stats)
        received = sum(s.bytes_received for s in self.stats)
        if self.shift is not None:
            sent += self.shift.bytes_sent - self._shift_before[0]
            received += self.shift.bytes_received - self._shift_before[1]
        return sent, received


def ring_allreduce(shift: Shift, x: torch.Tensor, step: int,
                   fmt: q.Format | None, generator: torch.Generator | None = None,
                   exact: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of `x` over the workers around the ring of `shift`, every hop's payload
    quantized as `fmt` (None: raw fp32), and the exact mean of `exact` (raw fp32 riding with
    the last piece). Reduce-scatter: each hop dequantizes what came, adds its own fp32 values
    and re-quantizes the partial sum for the next; all-gather: each owner quantizes its
    reduced piece once and the bytes travel on unchanged, so every worker ends with the same
    values (the owner too uses the dequantized piece)."""
    world, rank = shift.world, shift.rank
    exact = torch.zeros(0) if exact is None else exact.to(torch.float32)
    pieces = [piece.clone() for piece in torch.tensor_split(x.to(torch.float32), world)]
    raws = [torch.zeros(0)] * (world - 1) + [exact.clone()]

    def encode(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = raws[j].contiguous().view(torch.uint8)
        if fmt is None:
            return torch.cat([pieces[j].contiguous().view(torch.uint8), raw]), pieces[j]
        quantized = q.quantize(pieces[j], fmt, generator)
        return torch.cat([q.to_bytes(quantized), raw]), q.dequantize(quantized)

    def size(j: int) -> int:
        numel = pieces[j].numel()
        return (4 * numel if fmt is None else fmt.wire_size(numel)) + 4 * raws[j].numel()

    def decode(data: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        numel = pieces[j].numel()
        cut = 4 * numel if fmt is None else fmt.wire_size(numel)
        raw = data[cut:].clone().view(torch.float32)
        if fmt is None:
            return data[:cut].clone().view(torch.float32), raw
        return q.dequantize(q.from_bytes(data[:cut], numel, fmt)), raw

    for i in range(world - 1):  # reduce-scatter
        send, recv = (rank - i) % world, (rank - i - 1) % world
        data, _ = encode(send)
        values, raw = decode(shift.shift(data, size(recv), step), recv)
        pieces[recv] += values
        raws[recv] = raws[recv] + raw
    owned = (rank + 1) % world
    pieces[owned] /= world
    raws[owned] = raws[owned] / world
    data, pieces[owned] = encode(owned)
    for i in range(world - 1):  # all-gather: the bytes go on as they came
        recv = (rank - i) % world
        data = shift.shift(data, size(recv), step)
        pieces[recv], raws[recv] = decode(data, recv)
    return torch.cat(pieces), raws[-1]


class Quantized:
    """Group-wise INT8/INT4 two-step all-reduce over the inner collective's reliable
    neighbour exchange (ring: its TCP streams; lossy: its TCP mesh; gloo: isend/irecv)."""

    def __init__(self, *, bits: int = 8, group_size: int = 128, symmetric: bool = True,
                 stochastic: bool = False, seed: int = 0, rank: int = 0) -> None:
        self.fmt = q.Format(bits, group_size, symmetric, stochastic)
        self.kind = f"int{bits}"
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def set_shapes(self, shapes: Any) -> None:
        """Groups run along the flat vector: the shapes do not matter."""

    def reduce(self, call: Call, body: torch.Tensor, tail: torch.Tensor, step: int):
        assert call.shift is not None
        tail_bytes = tail.numel() * 4
        result, mean_tail = ring_allreduce(call.shift, body, step, self.fmt, self.generator,
                                           exact=tail)
        # The error of quantizing this worker's values, measured on one piece (a 1/N sample:
        # quantizing the whole vector again would cost as much as the all-reduce's own work).
        piece = torch.tensor_split(body, self.world_of(call))[call.shift.rank]
        own = q.dequantize(q.quantize(piece, self.fmt))
        norm = float(torch.linalg.vector_norm(piece))
        figures = {
            "payload_bytes": float(self.fmt.wire_size(body.numel()) + tail_bytes),
            "error": float(torch.linalg.vector_norm(own - piece)) / norm if norm > 0 else 0.0,
        }
        return result, mean_tail, figures

    @staticmethod
    def world_of(call: Call) -> int:
        assert call.shift is not None
        return call.shift.world

    def close(self) -> None:
        pass


def make_compressor(kind: str, worker: int = 0, /, **parameters: Any) -> Any:
    """Compressor `kind` with `parameters` (the `worker`'s rank seeds stochastic rounding); a
    bad kind or parameter is named with what is allowed."""
    allowed = compressor_kind(kind).parameters
    unknown = sorted(set(parameters) - set(allowed))
    if unknown:
        raise ValueError(f"compressor.{unknown[0]}: not a parameter of {kind}; allowed: "
                         f"{', '.join(allowed) or 'none'}")
    if kind == "none":
        return None
    if kind == "topk":
        return TopK(**parameters)
    if kind == "randk":
        return RandK(**parameters)
    if kind == "arc_topk":
        return ARCTopK(**parameters)
    if kind == "powersgd":
        if "rank" in parameters:
            parameters["rank"] = int(parameters["rank"])
        return PowerSGD(**parameters)
    return Quantized(bits=8 if kind == "int8" else 4, rank=worker, **parameters)


class Compressed(CollectiveBase):
    """`inner`'s all-reduce, its payload compressed by `compressor` (a sparsifier, a
    quantizer or PowerSGD); the last `dense_tail` values of every tensor travel exact."""

    def __init__(self, inner: CollectiveBase, compressor: Any, *, dense_tail: int = 0) -> None:
        if dense_tail < 0:
            raise ValueError(f"dense_tail: expected 0 or more, got {dense_tail}")
        self.inner, self.compressor, self.dense_tail = inner, compressor, dense_tail
        self.rank, self.world = inner.rank, inner.world
        self.name = f"{inner.name}+{compressor.kind}"
        self.shift = None if inner.world == 1 else (
            inner.neighbour_exchange()
            or mesh_shift(inner.mesh, inner.rank, inner.world, inner.timeout))
        needed = COMPRESSORS[compressor.kind].exchange_needed(inner.capabilities)
        if needed and self.shift is None and inner.world > 1:
            raise ValueError(
                f"compressor.kind: {compressor.kind} needs a reliable point-to-point exchange "
                f"(ring, lossy or gloo); {inner.name!r} has none (use randk, powersgd or none)")

    @property
    def capabilities(self) -> Capabilities:
        """The inner's, but the owners' update, which compression does not pass on."""
        return dataclasses.replace(self.inner.capabilities, sharded_step=False)

    def set_shapes(self, shapes: Any) -> None:
        """The shapes of the tensors the flat vectors are made of (a model's parameters, in
        order), for compressors that use them (PowerSGD: one matrix per weight)."""
        self.compressor.set_shapes(shapes)

    def pull_state(self) -> torch.Tensor | None:
        return self.inner.pull_state()

    def peer_moved(self, rank: int, host: str) -> None:
        self.inner.peer_moved(rank, host)

    @property
    def endpoint(self) -> Any:
        """The inner's datagram endpoint (lossy), for the metrics' transport counters."""
        return self.inner.endpoint

    @property
    def mesh(self) -> Any:
        """The inner's TCP streams (ring, lossy), for the metrics' transport counters; the
        neighbour exchanges of the compressors travel on them too."""
        return self.inner.mesh

    def allreduce(self, tensor: torch.Tensor, step: int) -> tuple[torch.Tensor, AllReduceStats]:
        started = time.monotonic()
        staged = Staged(tensor)
        flat = staged.host.to(torch.float32)
        cut = max(0, flat.numel() - self.dense_tail)
        body, tail = flat[:cut], flat[cut:]
        call = Call(self.inner, self.shift, step)
        if self.world == 1 or body.numel() == 0:
            mean_body, mean_tail = body.clone(), tail.clone()
            figures = {"payload_bytes": 4.0 * flat.numel(), "error": 0.0}
        else:
            mean_body, mean_tail, figures = self.compressor.reduce(call, body, tail, step)
        result = torch.cat([mean_body.reshape(-1), mean_tail.reshape(-1)])
        sent, received = call.bytes()
        last = call.stats[-1] if call.stats else None
        extra = dict(last.extra) if last is not None else {}
        dense = 4.0 * max(1, flat.numel())
        extra.update({
            "compression_ratio": figures["payload_bytes"] / dense,
            "compressed_bytes": figures["payload_bytes"],
            "compression_error": figures["error"],
            "inner_calls": float(len(call.stats)),
        })
        if "feedback_residual" in figures:
            extra["feedback_residual"] = figures["feedback_residual"]
        coverage = min((s.coverage for s in call.stats), default=1.0)
        missing = tuple(sorted({p for s in call.stats for p in s.peers_missing}))
        stats = AllReduceStats(self.name, step, seconds=time.monotonic() - started,
                               bytes_sent=sent, bytes_received=received, coverage=coverage,
                               peers_missing=missing, extra=extra)
        return staged.back(result), stats

    def close(self) -> None:
        try:
            self.compressor.close()
            if self.shift is not None:
                self.shift.close()
        finally:
            self.inner.close()


def wrap(inner: CollectiveBase, kind: str, *, dense_tail: int = 0,
         **parameters: Any) -> CollectiveBase:
    """`inner` with compressor `kind` (none: `inner` itself); closing it closes `inner`. If
    this raises, `inner` is left open (the caller's to close)."""
    compressor = make_compressor(kind, inner.rank, **parameters)
    if compressor is None:
        return inner
    return Compressed(inner, compressor, dense_tail=dense_tail)
