"""How workers combine their work each step, over any collective.

- `gradient`: synchronous data parallelism. All-reduce the summed micro-batch gradients with
  their count (micro-batch-weighted, see `dropcompute`), then every worker takes the same step.
- `average`: local SGD in the Moshpit style. Every worker steps on its own gradient and every
  `average_every` steps the workers all-reduce their parameters.
- `sharded`: the collective owns the update (the lossy all-reduce: each shard owner applies the
  optimizer to its shard and broadcasts fresh parameters). A collective with the capability
  `sharded_step` has `step(parameters_flat, gradient_flat, step, update) -> (parameters_flat,
  AllReduceStats)` (`base.ShardedStep`), calling `update(start, parameters, gradient) -> new
  parameters` for the slice of the flat vector that begins at `start` (see `ShardOptimizer`).
- `diloco`: DiLoCo and Streaming DiLoCo, inner steps and an outer optimizer (`diloco.DiLoCo`).

`job.make_strategy` picks one by the job's `strategy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from testbed.collectives.base import AllReduceStats, Collective, ShardedStep
from testbed.train import dropcompute
from testbed.train.config import OptimizerSpec


def build_optimizer(spec: OptimizerSpec,
                    parameters: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer `spec` names, over `parameters`."""
    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
            "adamw": torch.optim.AdamW}[spec.name]
    return kind(parameters, **spec.options())


def write_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` into `tensors` (the inverse of parameters_to_vector)."""
    with torch.no_grad():
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(part.view_as(tensor))


class Strategy(Protocol):
    """Turns this worker's summed micro-batch gradients into a parameter update."""

    def apply(self, gradient_sum: torch.Tensor, count: int, step: int) -> AllReduceStats | None:
        """Update the model; return the collective's stats, or None if it was not used."""
        ...


class GradientAllReduce:
    def __init__(self, collective: Collective, model: nn.Module, spec: OptimizerSpec) -> None:
        self.collective = collective
        self.parameters = list(model.parameters())
        self.optimizer = build_optimizer(spec, self.parameters)

    def apply(self, gradient_sum: torch.Tensor, count: int, step: int) -> AllReduceStats:
        mean, stats = self.collective.allreduce(dropcompute.pack(gradient_sum, count), step)
        optimizer_step(self.optimizer, self.parameters, dropcompute.unpack(mean))
        return stats


class ParameterAveraging:
    def __init__(
        self, collective: Collective, model: nn.Module, spec: OptimizerSpec, every: int
    ) -> None:
        self.collective = collective
        self.parameters = list(model.parameters())
        self.optimizer = build_optimizer(spec, self.parameters)
        self.every = every

    def apply(self, gradient_sum: torch.Tensor, count: int, step: int) -> AllReduceStats | None:
        optimizer_step(self.optimizer, self.parameters, gradient_sum / count)
        if (step + 1) % self.every:
            return None
        mean, stats = self.collective.allreduce(parameters_to_vector(self.parameters), step)
        write_flat(mean, self.parameters)
        return stats


class ShardOptimizer:
    """The optimizer step for slices of the flat parameter vector, called by shard owners.

    One torch optimizer per slice keeps that slice's state (momentum, Adam moments) with its
    owner; as these optimizers work element by element, updating the slices separately is the
    same as updating the whole vector."""

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec
        self._slices: dict[tuple[int, int], tuple[nn.Parameter, torch.optim.Optimizer]] = {}

    def __call__(
        self, start: int, parameters: torch.Tensor, gradient: torch.Tensor
    ) -> torch.Tensor:
        key = (start, parameters.numel())
        if key not in self._slices:
            holder = nn.Parameter(parameters.detach().clone())
            self._slices[key] = (holder, build_optimizer(self.spec, [holder]))
        holder, optimizer = self._slices[key]
        optimizer_step(optimizer, [holder], gradient, parameters)
        return holder.detach().clone()


class ShardedUpdate:
    def __init__(self, collective: Collective, model: nn.Module, spec: OptimizerSpec) -> None:
        if not isinstance(collective, ShardedStep):
            raise ValueError(
                f"strategy sharded: collective {collective.name!r} has no step(parameters, "
                "gradient, step, update); use strategy gradient or average"
            )
        self.sharded_step = collective.step
        self.parameters = list(model.parameters())
        self.update = ShardOptimizer(spec)

    def apply(self, gradient_sum: torch.Tensor, count: int, step: int) -> AllReduceStats:
        flat = parameters_to_vector(self.parameters).detach()
        fresh, stats = self.sharded_step(flat, gradient_sum / count, step, self.update)
        write_flat(fresh, self.parameters)
        return stats


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    parameters: Sequence[torch.Tensor],
    gradient: torch.Tensor,
    values: torch.Tensor | None = None,
) -> None:
    """One optimizer step with `gradient` (flat) as the gradient, from `values` if given."""
    if values is not None:
        write_flat(values, parameters)
    for parameter in parameters:
        parameter.grad = torch.empty_like(parameter)
    write_flat(gradient, [p.grad for p in parameters])
    optimizer.step()
