"""Error feedback, which keeps what a sparsifier did not send: EF21M (the default) and EF14.

EF21M: error feedback with momentum (Fatkhullin, Tyurin and Richtarik, "Momentum Provably
Improves Error Feedback!", 2023).

Worker i keeps a momentum v_i and an estimate g_i of it; every worker keeps the shared
estimate g (the mean of the g_i). The first step starts them from the gradient d_i itself,
sent whole: v_i = g_i = d_i, g = mean_i d_i (one dense all-reduce), as EF21M's algorithm and
ARC-Top-K's code (`comm_hooks/group_topk_hook_no_reshape.py`, EF21's E_0) do. Every later
step, with a compressor C:

    v_i <- (1 - eta) v_i + eta d_i
    c_i  = C(v_i - g_i)          (only c_i travels)
    g_i <- g_i + c_i
    g   <- g + mean_i c_i        (the all-reduced quantity)

and g is what the workers step on. With eta = 1 this is EF21. `residual` ||v_i - g_i|| is
what is held back: with a contractive C (Top-K, Rand-K, ARC-Top-K keep at least a fraction
of v - g) it stays bounded as long as the gradients do (tests/unit/test_compression.py).

EF14 (classic error feedback, "ef14" in ARC-Top-K's hooks and the command lines of its
README): worker i keeps the error e_i of what it did not send, and the workers step on the
mean of what was sent this step:

    c_i  = C(d_i + e_i)          (only c_i travels)
    e_i <- d_i + e_i - c_i
    result = mean_i c_i

A coordinate left out is not stepped on until it is sent (EF21M steps on its last sent value
meanwhile), and nothing is shared between the workers but the result.
"""

from __future__ import annotations

import torch


class EF21M:
    """One worker's EF21M state for flat vectors of one length (set on the first call)."""

    def __init__(self, momentum: float = 1.0) -> None:
        if not 0 < momentum <= 1:
            raise ValueError(f"momentum: expected 0 < eta <= 1 (1: EF21), got {momentum}")
        self.eta = momentum
        self.v: torch.Tensor | None = None
        self.own: torch.Tensor | None = None  # g_i
        self.shared: torch.Tensor | None = None  # g

    @property
    def started(self) -> bool:
        """Whether the first step (`start`) has set the state."""
        return self.v is not None

    def start(self, gradient: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The first step: v_i = g_i = `gradient`, g = `mean` (the exact mean of the workers'
        gradients, sent whole); returns a copy of g. Starting g at the true mean, not at 0,
        leaves nothing held back to be caught up over the next steps."""
        gradient = gradient.detach().to(torch.float32)
        self.v, self.own = gradient.clone(), gradient.clone()
        self.shared = mean.detach().to(torch.float32).clone()
        return self.shared.clone()

    def target(self, gradient: torch.Tensor) -> torch.Tensor:
        """Update the momentum with `gradient`; the vector to compress, v_i - g_i."""
        if self.v is None or self.own is None:
            raise RuntimeError("EF21M: start() comes first")
        self.v.mul_(1 - self.eta).add_(gradient.detach().to(torch.float32), alpha=self.eta)
        return self.v - self.own

    def commit(self, own_index: torch.Tensor, own_values: torch.Tensor,
               mean_index: torch.Tensor | None, mean_values: torch.Tensor) -> torch.Tensor:
        """g_i += c_i (its values at `own_index`), g += mean c (at `mean_index`; None: the
        whole vector); returns a copy of the new shared estimate g."""
        assert self.own is not None and self.shared is not None
        self.own.index_add_(0, own_index, own_values.to(torch.float32))
        if mean_index is None:
            self.shared.add_(mean_values.to(torch.float32))
        else:
            self.shared.index_add_(0, mean_index, mean_values.to(torch.float32))
        return self.shared.clone()

    def resync(self, mean_own: torch.Tensor) -> None:
        """Set the shared estimate to the exact mean of the g_i (over an inexact collective,
        the copies of g drift apart where a worker's own value stood in for a lost mean)."""
        self.shared = mean_own.detach().to(torch.float32).clone()

    @property
    def residual(self) -> float:
        """||v_i - g_i||: what this worker has not sent yet."""
        if self.v is None or self.own is None:
            return 0.0
        return float(torch.linalg.vector_norm(self.v - self.own))


class EF14:
    """One worker's EF14 state for flat vectors of one length (zero until the first call)."""

    started = True  # no first step of its own: the error starts at zero

    def __init__(self) -> None:
        self.error: torch.Tensor | None = None
        self._target: torch.Tensor | None = None

    def target(self, gradient: torch.Tensor) -> torch.Tensor:
        """The vector to compress, d_i + e_i."""
        gradient = gradient.detach().to(torch.float32)
        self._target = gradient + self.error if self.error is not None else gradient.clone()
        return self._target

    def commit(self, own_index: torch.Tensor, own_values: torch.Tensor,
               mean_index: torch.Tensor | None, mean_values: torch.Tensor) -> torch.Tensor:
        """e_i = target - c_i (c_i: `own_values` at `own_index`); returns mean c, dense (its
        values at `mean_index`; None: `mean_values` is dense already)."""
        assert self._target is not None
        self.error = self._target
        # (a copy: `own_values` may be a view of the target itself)
        self.error.index_add_(0, own_index, own_values.to(torch.float32).clone(), alpha=-1.0)
        if mean_index is None:
            return mean_values.to(torch.float32).clone()
        result = torch.zeros_like(self.error)
        result[mean_index] = mean_values.to(torch.float32)
        return result

    @property
    def residual(self) -> float:
        """||e_i||: what this worker has not sent yet."""
        return 0.0 if self.error is None else float(torch.linalg.vector_norm(self.error))
