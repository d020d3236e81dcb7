"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019) over any exact collective, one power iteration
per step with a warm start and PowerSGD's own error feedback. Per matrix M (with error memory
e and the previous Q):

    M = x + e;  P = mean_i(M_i Q);  P = orthonormal(P);  Q = mean_i(M_i^T P);
    result = P Q^T;  e = M - result   (e per worker: its M less the shared approximation)

Given the tensors' `shapes` (`set_shapes`: the model's parameters, in the flat vector's
order), every tensor of two or more dimensions is its own matrix (shape[0] x the rest) and the
vectors (biases) travel uncompressed, as torch's `ddp_comm_hooks.powerSGD_hook` does; all P
factors go in one all-reduce, all Q factors with the vectors in a second. Without shapes the
whole flat vector is one near-square matrix, which has little low-rank structure: give shapes
where they are known (the cluster worker does). benchmarks/compression.py races torch's hook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class PowerSGD:
    kind = "powersgd"

    def __init__(self, *, rank: int = 2, seed: int = 0, error_feedback: bool = True) -> None:
        if rank < 1:
            raise ValueError(f"rank: expected 1 or more, got {rank}")
        self.rank, self.seed, self.error_feedback = rank, seed, error_feedback
        self.shapes: list[tuple[int, ...]] | None = None
        # Error memory and warm-started Q factors per tensor length (a DDP hook's buckets each
        # their own).
        self.state: dict[int, tuple[torch.Tensor | None, list[torch.Tensor]]] = {}

    def set_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the tensors the flat vectors are made of, in order."""
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]

    def _layout(self, numel: int) -> list[tuple[int, int, int] | int]:
        """Per piece of the flat vector: (start, rows, cols) for a matrix, or its length for
        a vector that travels uncompressed."""
        shapes = self.shapes
        if shapes is None or sum(math.prod(s) for s in shapes) != numel:
            cols = max(1, math.ceil(math.sqrt(numel)))
            rows = numel // cols
            pieces: list[tuple[int, int, int] | int] = [(0, rows, cols)] if rows else []
            if numel - rows * cols:
                pieces.append(numel - rows * cols)
            return pieces
        pieces, start = [], 0
        for shape in shapes:
            size = math.prod(shape)
            if len(shape) >= 2 and min(shape[0], size // max(1, shape[0])) > self.rank:
                pieces.append((start, shape[0], size // shape[0]))
            else:
                pieces.append(size)
            start += size
        return pieces

    def reduce(self, call, body: torch.Tensor, tail: torch.Tensor, step: int):
        n = body.numel()
        memory, qs = self.state.get(n, (None, []))
        m = body.to(torch.float32).clone()
        if self.error_feedback:
            if memory is None:
                memory = torch.zeros_like(m)
            m += memory
        layout = self._layout(n)
        matrices, vectors, starts = [], [], []
        at = 0
        for piece in layout:
            if isinstance(piece, tuple):
                start, rows, cols = piece
                matrices.append(m[start: start + rows * cols].view(rows, cols))
                starts.append(start)
                at = start + rows * cols
            else:
                vectors.append(slice(at, at + piece))
                at += piece
        if len(qs) != len(matrices):  # the same seeded start on every worker
            generator = torch.Generator().manual_seed(self.seed)
            qs = [torch.randn(mat.shape[1], self.rank, generator=generator) for mat in matrices]
        ps = call.allreduce(torch.cat([(mat @ q).reshape(-1) for mat, q in
                                       zip(matrices, qs, strict=True)] or [torch.zeros(0)]))
        ps_split, at = [], 0
        for mat in matrices:
            p = ps[at: at + mat.shape[0] * self.rank].view(mat.shape[0], self.rank)
            ps_split.append(torch.linalg.qr(p)[0])
            at += mat.shape[0] * self.rank
        local_q = [(mat.T @ p).reshape(-1) for mat, p in zip(matrices, ps_split, strict=True)]
        raw = [m[s] for s in vectors]
        both = call.allreduce(torch.cat([*local_q, *raw, tail.to(torch.float32)]))
        result = torch.empty(n, dtype=torch.float32)
        at, new_qs = 0, []
        for mat, p, start in zip(matrices, ps_split, starts, strict=True):
            q = both[at: at + mat.shape[1] * self.rank].view(mat.shape[1], self.rank).clone()
            new_qs.append(q)
            result[start: start + mat.numel()] = (p @ q.T).reshape(-1)
            at += mat.shape[1] * self.rank
        for s in vectors:
            length = s.stop - s.start
            result[s] = both[at: at + length]
            at += length
        mean_tail = both[at:]
        if self.error_feedback:  # as torch's hook: what the aggregate left out here
            memory = m - result
            for s in vectors:  # sent exact: nothing left out
                memory[s] = 0
        self.state[n] = (memory, new_qs)
        sent = at + tail.numel()  # Q factors, vectors and tail
        sent += sum(mat.shape[0] * self.rank for mat in matrices)  # P factors
        norm = float(torch.linalg.vector_norm(m))
        figures = {
            "payload_bytes": float(4 * sent),
            "error": float(torch.linalg.vector_norm(m - result)) / norm if norm > 0 else 0.0,
        }
        return result, mean_tail, figures

    def close(self) -> None:
        pass
