"""Sparsifiers: Top-K (indices and values all-gathered), Rand-K (a shared seed picks the same
coordinates everywhere) and ARC-Top-K (every worker picks the same coordinates from an
all-reduced sketch, so values travel index-free through any collective), each with EF21M error
feedback.

Every sparsifier turns this worker's vector x (with EF21M: v_i - g_i) into c_i = x on a
pattern of coordinates and 0 elsewhere; the patterns differ per worker only for Top-K.

ARC-Top-K has two sketches (docs/compression.md): `projection`, the paper's (Chen et al.,
arXiv:2510.26709; its code: `comm_hooks/group_topk_hook_no_reshape.py` of
github.com/yiran529/ARC-TopK), which projects every weight matrix's rows on a shared random
matrix, all-reduces the projections and keeps the rows whose projected mean is largest; and
`marginal`, this project's earlier one, which sums every matrix's row and column energies and
keeps the single coordinates whose rank-one estimate of energy is largest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from testbed.collectives.compression.feedback import EF14, EF21M
from testbed.collectives.registry import ARC_SKETCHES, FEEDBACKS


@dataclass
class Exchanged:
    """What one sparse exchange gave: this worker's c_i (`own_index`, `own_values`), the mean
    of the c_i (at `mean_index`; None: dense), the mean of the exact tail, and the bytes this
    worker's compressed contribution takes (`payload_bytes`)."""

    own_index: torch.Tensor
    own_values: torch.Tensor
    mean_index: torch.Tensor | None
    mean_values: torch.Tensor
    mean_tail: torch.Tensor
    payload_bytes: int


def count_of(density: float, numel: int) -> int:
    """How many of `numel` things a `density` keeps (at least 1)."""
    return max(1, min(numel, math.ceil(density * numel)))


def layout(shapes: Sequence[tuple[int, ...]] | None, numel: int,
           block: int) -> list[tuple[int, int, int]]:
    """The flat vector as pieces (start, rows, cols) for ARC-Top-K's marginal sketch: each
    weight of two or more dimensions a matrix (shape[0] x the rest), every other tensor a
    column (cols 1: sketched per coordinate). Without `shapes` (or if they do not add up to
    `numel`, as for a DDP bucket) the vector is one matrix of rows of `block` consecutive
    values, its rows the blocks, and a column for the ragged end."""
    pieces, start = [], 0
    if shapes is None or sum(math.prod(shape) for shape in shapes) != numel:
        rows = numel // block
        sizes = [(rows, block)] if rows else []
        if numel - rows * block:
            sizes.append((numel - rows * block, 1))
    else:
        sizes = []
        for shape in shapes:
            size = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else size
            # A matrix's sketch is rows + cols + 1 values: worth it only when that is smaller.
            sizes.append((rows, size // rows) if rows + size // rows + 1 < size else (size, 1))
    for rows, cols in sizes:
        if rows * cols:
            pieces.append((start, rows, cols))
        start += rows * cols
    return pieces


def marginal_sketch(x: torch.Tensor, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
    """What one worker adds to ARC-Top-K's sketch: per matrix piece the energy (sum of
    squares) of each row, of each column and of the whole; per column piece the energy of
    each coordinate. Sums of these over the workers are the same sums over the pooled
    energies, so the sketch all-reduces."""
    energy = x.to(torch.float32).square()
    parts = []
    for start, rows, cols in pieces:
        piece = energy[start: start + rows * cols]
        if cols == 1:
            parts.append(piece)
        else:
            matrix = piece.view(rows, cols)
            parts += [matrix.sum(dim=1), matrix.sum(dim=0), matrix.sum().reshape(1)]
    return torch.cat(parts) if parts else torch.zeros(0)


def marginal_scores(sketch: torch.Tensor, pieces: list[tuple[int, int, int]],
                    numel: int) -> torch.Tensor:
    """Each coordinate's estimated energy from the summed sketch: R_a C_b / T in a matrix
    (the rank-one estimate its row and column energies give), the energy itself in a column.
    Elementwise arithmetic on the same sketch: bitwise the same on every worker."""
    scores = torch.zeros(numel, dtype=torch.float32)
    at = 0
    for start, rows, cols in pieces:
        if cols == 1:
            scores[start: start + rows] = sketch[at: at + rows]
            at += rows
            continue
        row, col = sketch[at: at + rows], sketch[at + rows: at + rows + cols]
        total = sketch[at + rows + cols]
        at += rows + cols + 1
        if total > 0:
            scores[start: start + rows * cols] = (row[:, None] * col[None, :] / total).reshape(-1)
    return scores


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The (rows, cols) the paper's code views a weight as, None for a vector (sent whole):
    a 2-D weight as it is; a convolution's as rows of 2 t^2 values, t its last dimension (two
    t x t kernels a row), where they divide it, else shape[0] x the rest."""
    size = math.prod(shape)
    if len(shape) < 2 or shape[0] in (0, size):
        return None
    if len(shape) == 2:
        return shape[0], shape[1]
    cols = 2 * shape[-1] ** 2
    return (size // cols, cols) if size % cols == 0 else (shape[0], size // shape[0])


def projection_layout(shapes: Sequence[tuple[int, ...]] | None, numel: int,
                      block: int) -> list[tuple[int, int, int]]:
    """The flat vector as pieces (start, rows, cols) for the projection sketch: a weight
    matrix (`matrix_view`) has cols > 1, a vector (bias, norm) is one piece of cols 0, sent
    whole. Without `shapes` (or if they do not add up to `numel`) the vector is one matrix of
    rows of `block` consecutive values and the ragged end a vector."""
    if shapes is None or sum(math.prod(shape) for shape in shapes) != numel:
        rows = numel // block
        views: list[tuple[int, int] | None] = [(rows, block)] if rows else []
        sizes = [rows * block] if rows else []
        if numel - rows * block:
            views.append(None)
            sizes.append(numel - rows * block)
    else:
        views = [matrix_view(shape) for shape in shapes]
        sizes = [math.prod(shape) for shape in shapes]
    pieces, start = [], 0
    for view, size in zip(views, sizes, strict=True):
        if size:
            pieces.append((start, *view) if view else (start, size, 0))
        start += size
    return pieces


def projections(pieces: list[tuple[int, int, int]], rank: int, seed: int, step: int,
                call: int) -> list[torch.Tensor]:
    """One cols x `rank` standard normal matrix per weight matrix of `pieces`, drawn from
    (seed, step, call) alone: every worker draws the same ones, new each call (the paper's
    V, drawn from a seed the workers share)."""
    generator = torch.Generator().manual_seed(
        int(np.random.default_rng([seed, step, call]).integers(2 ** 62)))
    return [torch.randn(cols, rank, generator=generator) for _, _, cols in pieces if cols]


def projection_sketch(x: torch.Tensor, pieces: list[tuple[int, int, int]],
                      basis: list[torch.Tensor]) -> torch.Tensor:
    """What one worker adds to the projection sketch: every weight matrix Y's rows projected,
    Y V (rows x rank), flat. It is linear in Y, so the workers' sum is the projection of
    their sum, sum_i Y_i V: the sketch all-reduces."""
    matrices = [(start, rows, cols) for start, rows, cols in pieces if cols]
    parts = [(x[start: start + rows * cols].view(rows, cols) @ v).reshape(-1)
             for (start, rows, cols), v in zip(matrices, basis, strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0)


def projection_pattern(sketch: torch.Tensor, pieces: list[tuple[int, int, int]], rank: int,
                       density: float) -> torch.Tensor:
    """The coordinates to send, ascending, from the summed sketch: of every weight matrix the
    max(1, floor(density * rows)) rows a of largest ||(sum_i Y_i V)_a||^2, an estimate of the
    aggregate's row energy ||sum_i Y_ia||^2 (times `rank`), whole; every vector whole.
    Elementwise arithmetic and ties to the lower row, on the same sketch: the same pattern on
    every worker."""
    chosen, at = [], 0
    for start, rows, cols in pieces:
        if not cols:
            chosen.append(torch.arange(start, start + rows))
            continue
        energy = sketch[at: at + rows * rank].view(rows, rank).square().sum(dim=1)
        at += rows * rank
        picked = top_coordinates(energy, max(1, int(density * rows)))
        chosen.append((start + picked[:, None] * cols + torch.arange(cols)).reshape(-1))
    return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64)


def top_coordinates(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` coordinates of largest score, ascending; ties at the cut go to the lower
    coordinates, so the same scores give the same pattern on every worker."""
    if count >= scores.numel():
        return torch.arange(scores.numel())
    cut = torch.topk(scores, count, sorted=False).values.min()
    above = torch.nonzero(scores > cut).reshape(-1)
    tied = torch.nonzero(scores == cut).reshape(-1)[: count - above.numel()]
    return torch.cat([above, tied]).sort().values


def random_coordinates(numel: int, count: int, seed: int, step: int, call: int) -> torch.Tensor:
    """`count` distinct coordinates drawn from (seed, step, call) alone: every worker draws the
    same ones without a word exchanged (ascending)."""
    rng = np.random.default_rng([seed, step, call])
    chosen = rng.choice(numel, size=count, replace=False)
    return torch.from_numpy(np.sort(chosen).astype(np.int64))


class Sparsifier:
    """The shared part: EF21M around a pattern-specific exchange (`_exchange`)."""

    kind = "sparse"

    def set_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """Only ARC-Top-K uses the parameters' shapes (its sketch's rows)."""

    def __init__(self, *, density: float = 0.01, error_feedback: bool = True,
                 feedback: str = "ef21m", momentum: float = 1.0, resync_every: int = 0) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density: expected a fraction 0 < density <= 1, got {density}")
        if resync_every < 0:
            raise ValueError(f"resync_every: expected 0 (never) or more, got {resync_every}")
        if feedback not in FEEDBACKS:
            raise ValueError(f"feedback: expected one of {', '.join(FEEDBACKS)}, got "
                             f"{feedback!r}")
        if feedback == "ef14" and (momentum != 1.0 or resync_every):
            raise ValueError("momentum and resync_every are EF21M's: feedback ef14 keeps no "
                             "momentum and no shared estimate")
        self.density = density
        self.error_feedback, self.momentum = error_feedback, momentum
        self.rule = feedback
        # One error-feedback state per tensor length: a DDP hook's buckets (of different
        # lengths) each keep their own.
        self.feedbacks: dict[int, EF21M | EF14] = {}
        self.feedback: EF21M | EF14 | None = None  # the state of the current call
        EF21M(momentum)  # checks it
        self.resync_every = resync_every
        self._calls = 0

    def _new_feedback(self) -> EF21M | EF14:
        return EF21M(self.momentum) if self.rule == "ef21m" else EF14()

    def reduce(self, call, body: torch.Tensor, tail: torch.Tensor, step: int) -> tuple[
            torch.Tensor, torch.Tensor, dict[str, float]]:
        """The (estimated) mean of the workers' `body`s and the exact mean of their `tail`s."""
        self._calls += 1
        if self.error_feedback:
            if body.numel() not in self.feedbacks:
                self.feedbacks[body.numel()] = self._new_feedback()
            self.feedback = self.feedbacks[body.numel()]
            if not self.feedback.started:  # EF21M's first step: the gradients sent whole
                assert isinstance(self.feedback, EF21M)
                mean = call.exact_mean(torch.cat([body, tail]).to(torch.float32))
                result = self.feedback.start(body, mean[: body.numel()])
                figures = {"payload_bytes": 4.0 * (body.numel() + tail.numel()), "error": 0.0,
                           "feedback_residual": 0.0}
                return result, mean[body.numel():], figures
        x = self.feedback.target(body) if self.feedback is not None else body.to(torch.float32)
        got = self._exchange(call, x, tail, step)
        if self.feedback is not None:
            result = self.feedback.commit(got.own_index, got.own_values, got.mean_index,
                                          got.mean_values)
            if self.resync_every and self._calls % self.resync_every == 0:
                assert isinstance(self.feedback, EF21M) and self.feedback.own is not None
                self.feedback.resync(call.exact_mean(self.feedback.own))
                result = self.feedback.shared.clone()  # type: ignore[union-attr]
        elif got.mean_index is None:
            result = got.mean_values.clone()
        else:
            result = torch.zeros(body.numel(), dtype=torch.float32)
            result[got.mean_index] = got.mean_values
        norm = float(torch.linalg.vector_norm(x))
        kept = float(torch.linalg.vector_norm(got.own_values))
        figures = {
            "payload_bytes": float(got.payload_bytes),
            "error": math.sqrt(max(0.0, norm * norm - kept * kept)) / norm if norm > 0 else 0.0,
        }
        if self.feedback is not None:
            figures["feedback_residual"] = self.feedback.residual
        return result, got.mean_tail, figures

    def _exchange(self, call, x: torch.Tensor, tail: torch.Tensor, step: int) -> Exchanged:
        raise NotImplementedError

    def _shared_pattern(self, call, index: torch.Tensor, x: torch.Tensor,
                        tail: torch.Tensor) -> Exchanged:
        """Values at a pattern every worker shares, all-reduced index-free (with the tail)."""
        values = x[index]
        mean = call.allreduce(torch.cat([values, tail.to(torch.float32)]))
        return Exchanged(index, values, index, mean[: index.numel()], mean[index.numel():],
                         4 * (index.numel() + tail.numel()))

    def close(self) -> None:
        pass


class RandK(Sparsifier):
    """Rand-K: the coordinates come from a seed shared by every worker (seed, step, call
    number), so only values travel, through any collective."""

    kind = "randk"

    def __init__(self, *, seed: int = 0, **options) -> None:
        super().__init__(**options)
        self.seed = seed

    def _exchange(self, call, x, tail, step):
        index = random_coordinates(x.numel(), count_of(self.density, x.numel()), self.seed,
                                   step, self._calls)
        return self._shared_pattern(call, index, x, tail)


class ARCTopK(Sparsifier):
    """ARC-Top-K: the workers agree on one pattern from a sketch summed over them identically
    everywhere, and only the values at it travel, index-free. `sketch` projection (the
    paper's): every weight matrix's rows projected on a shared random matrix of `sketch_rank`
    columns, the rows of largest projected aggregate kept whole (`density` of each matrix's
    rows), vectors whole; marginal: every matrix's row and column energies, the density * n
    coordinates of largest estimated energy over the whole vector. Without the shapes, rows
    are blocks of `block` consecutive values."""

    kind = "arc_topk"

    def __init__(self, *, sketch: str = "projection", sketch_rank: int = 4, block: int = 64,
                 seed: int = 0, **options) -> None:
        super().__init__(**options)
        if sketch not in ARC_SKETCHES:
            raise ValueError(f"sketch: expected one of {', '.join(ARC_SKETCHES)}, got "
                             f"{sketch!r}")
        if block < 1:
            raise ValueError(f"block: expected 1 or more coordinates per block, got {block}")
        if sketch_rank < 1:
            raise ValueError(f"sketch_rank: expected 1 or more columns, got {sketch_rank}")
        self.sketch, self.sketch_rank, self.block, self.seed = sketch, sketch_rank, block, seed
        self.shapes: list[tuple[int, ...]] | None = None
        self.last_index: torch.Tensor | None = None  # for tests: the pattern agreed on

    def set_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """The shapes of the tensors the flat vectors are made of, in order."""
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]

    def pattern(self, call, x: torch.Tensor, step: int) -> tuple[torch.Tensor, int]:
        """The coordinates every worker sends (ascending, the same on every worker) and the
        number of sketch values this worker contributed."""
        if self.sketch == "marginal":
            scores, sketched = self.scores(call, x)
            return top_coordinates(scores, count_of(self.density, x.numel())), sketched
        pieces = projection_layout(self.shapes, x.numel(), self.block)
        basis = projections(pieces, self.sketch_rank, self.seed, step, self._calls)
        sketch = call.agree(projection_sketch(x, pieces, basis))
        return projection_pattern(sketch, pieces, self.sketch_rank, self.density), sketch.numel()

    def scores(self, call, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The marginal sketch's score of every coordinate, the same on every worker, and the
        number of sketch values this worker contributed."""
        pieces = layout(self.shapes, x.numel(), self.block)
        sketch = call.agree(marginal_sketch(x, pieces))
        return marginal_scores(sketch, pieces, x.numel()), sketch.numel()

    def _exchange(self, call, x, tail, step):
        index, sketched = self.pattern(call, x, step)
        self.last_index = index
        got = self._shared_pattern(call, index, x, tail)
        got.payload_bytes += 4 * sketched
        return got


class TopK(Sparsifier):
    """Top-K: each worker keeps its own k largest |x|; indices (int32) and values (fp32) are
    all-gathered around the ring over the inner collective's reliable transport, then every
    worker sums them in rank order (the same result everywhere)."""

    kind = "topk"

    def _exchange(self, call, x, tail, step):
        k = count_of(self.density, x.numel())
        index = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        values = x[index]
        payload = torch.cat([index.to(torch.int32).view(torch.uint8), values.view(torch.uint8),
                             tail.to(torch.float32).contiguous().view(torch.uint8)])
        gathered = call.all_gather(payload)
        total = torch.zeros(x.numel(), dtype=torch.float32)
        tails = torch.zeros(tail.numel(), dtype=torch.float32)
        for data in gathered:  # in rank order: every worker adds in the same order
            theirs = data[: 4 * k].clone().view(torch.int32).to(torch.int64)
            total.index_add_(0, theirs, data[4 * k: 8 * k].clone().view(torch.float32))
            tails += data[8 * k:].clone().view(torch.float32)
        world = len(gathered)
        return Exchanged(index, values, None, total / world, tails / world, payload.numel())
