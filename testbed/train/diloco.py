"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025): strategy
`diloco`, over any collective and its compressor.

Every worker takes `inner_steps` (H) steps of its own inner optimizer (the job's `optimizer`,
AdamW by default). Then its pseudo-gradient, the parameters at the last sync minus its
parameters now, goes through the collective once (the workers' mean), and every worker applies
the outer optimizer (SGD with Nesterov momentum) to the synced parameters with that mean: the
result is the new synced parameters, and the worker's own.

Streaming cuts the parameter tensors into P fragments of consecutive tensors and about equal
size. Fragment p is synchronised after the steps n (counted from 1) with (n - offset_p) % H ==
0, offset_p = p * H // P: one all-reduce of a P-th of the model every H / P steps instead of
the whole model every H. With `overlap`, the all-reduces run on a thread of their own
(`OuterCalls`) beside the inner steps, and a result is applied at the first step it is back,
mixed with the local parameters as the paper does: local <- alpha * local + (1 - alpha) *
synced. The inner loop then waits only where a fragment's next all-reduce is due before its
last result came back; the last step also waits for what is still in flight (the end of
training, not an inner step's wait: `outer_wait_seconds` leaves it out).

A step that applied outer updates returns its all-reduce's stats with these figures added to
`extra` (so they reach the step events and the metrics): `outer_step` (outer updates this worker
applied so far, the last one's number), `outer_updates` (applied in this step), `fragment` (the
last one's, streaming only), `pseudo_gradient_norm` (of the mean pseudo-gradient) and
`outer_wait_seconds`. Its outer state (the synced parameters, the outer momentum, the count of
outer updates) is one flat vector, `state()` and `restore()`: what a restarted worker takes
from a live one to rejoin at the next outer step.
"""

from __future__ import annotations

import bisect
import itertools
import math
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from testbed.collectives.base import AllReduceStats, Collective
from testbed.train.config import TrainConfig
from testbed.train.strategies import build_optimizer, optimizer_step, write_flat

Call = Future[tuple[torch.Tensor, AllReduceStats]]


def fragment_ranges(sizes: Sequence[int], count: int) -> list[range]:
    """`count` runs of consecutive tensors (indices into `sizes`, their element counts) of about
    equal total size, none empty; each boundary is the one nearest its share of the total."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"streaming.fragments: expected 1 to the model's {len(sizes)} "
                         f"parameter tensors, got {count}")
    cumulative = list(itertools.accumulate(sizes))
    starts = [0]
    for k in range(1, count):
        target = cumulative[-1] * k / count
        reached = bisect.bisect_left(cumulative, target)  # tensors 0..reached reach the target
        nearer_before = reached > 0 and target - cumulative[reached - 1] < cumulative[reached] \
            - target
        boundary = reached if nearer_before else reached + 1
        starts.append(max(starts[-1] + 1, min(boundary, len(sizes) - (count - k))))
    return [range(a, b) for a, b in zip(starts, [*starts[1:], len(sizes)], strict=True)]


class OuterCalls:
    """The outer all-reduces on a daemon thread of their own, one after another in the order
    submitted: every worker submits the same calls in the same order, so the collective's
    calls stay in step."""

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self._calls: queue.SimpleQueue[tuple[Call, torch.Tensor, int] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="outer-allreduce", daemon=True)
        self._thread.start()

    def submit(self, tensor: torch.Tensor, step: int) -> Call:
        call: Call = Future()
        self._calls.put((call, tensor, step))
        return call

    def close(self) -> None:
        """End the thread once the calls submitted are done."""
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, tensor, step = item
            try:
                call.set_result(self.collective.allreduce(tensor, step))
            except BaseException as error:  # raised where the result is taken
                call.set_exception(error)


@dataclass
class Fragment:
    """Some of the model's parameter tensors, synchronised together: the synced copies the
    outer optimizer steps, and the all-reduce in flight, if any."""

    index: int
    offset: int  # synchronised after the steps n with (n - offset) % H == 0
    parameters: list[nn.Parameter]
    synced: list[nn.Parameter]
    outer: torch.optim.Optimizer
    pending: Call | None = None
    waited: float = 0.0  # seconds the inner loop waited for the call in flight so far


@dataclass
class OuterUpdate:
    """What applying one fragment's outer update did."""

    fragment: int
    stats: AllReduceStats
    norm: float  # of the mean pseudo-gradient
    waited: float


class DiLoCo:
    """Strategy `diloco`: inner steps of the job's optimizer, an outer step every `inner_steps`
    (per fragment, streaming), the pseudo-gradients through the collective."""

    def __init__(self, collective: Collective, model: nn.Module, config: TrainConfig) -> None:
        self.collective = collective
        self.parameters = list(model.parameters())
        self.inner = build_optimizer(config.optimizer, self.parameters)
        self.every, self.steps = config.inner_steps, config.steps
        streaming = config.streaming
        self.streaming = streaming is not None
        self.local_weight = streaming.local_weight if streaming is not None else 0.0
        count = streaming.fragments if streaming is not None else 1
        ranges = fragment_ranges([p.numel() for p in self.parameters], count)
        self.fragments: list[Fragment] = []
        for index, tensors in enumerate(ranges):
            synced = [nn.Parameter(self.parameters[i].detach().clone()) for i in tensors]
            self.fragments.append(Fragment(
                index, index * self.every // count, [self.parameters[i] for i in tensors],
                synced, torch.optim.SGD(synced, **config.outer.options())))
        self.calls = OuterCalls(collective) if streaming is not None and streaming.overlap \
            else None
        self.outer_steps = 0

    def apply(self, gradient_sum: torch.Tensor, count: int, step: int) -> AllReduceStats | None:
        """The inner step; then the outer updates that are back or due, and the all-reduces
        due after this step."""
        optimizer_step(self.inner, self.parameters, gradient_sum / count)
        last = step == self.steps - 1
        updates = []
        for fragment in self.fragments:
            due = (step + 1 - fragment.offset) % self.every == 0
            if fragment.pending is not None and (due or last or fragment.pending.done()):
                updates.append(self._receive(fragment, drain=last and not due))
            if due:
                self._send(fragment, step)
                if self.calls is None or last:
                    updates.append(self._receive(fragment, drain=self.calls is not None))
        if last and self.calls is not None:
            self.calls.close()
        return self._figures(updates, step)

    def _send(self, fragment: Fragment, step: int) -> None:
        """The fragment's pseudo-gradient to the collective: on the outer thread with overlap,
        else here (the inner loop waits for all of it)."""
        pseudo_gradient = (parameters_to_vector(fragment.synced)
                           - parameters_to_vector(fragment.parameters)).detach()
        if self.calls is not None:
            fragment.pending, fragment.waited = self.calls.submit(pseudo_gradient, step), 0.0
            return
        started = time.perf_counter()
        call: Call = Future()
        call.set_result(self.collective.allreduce(pseudo_gradient, step))
        fragment.pending, fragment.waited = call, time.perf_counter() - started

    def _receive(self, fragment: Fragment, *, drain: bool) -> OuterUpdate:
        """Take the fragment's result (waiting for it if it is not back: counted, but for the
        `drain` at the end of training) and apply the outer step."""
        assert fragment.pending is not None
        started, back = time.perf_counter(), fragment.pending.done()
        mean, stats = fragment.pending.result()
        waited = fragment.waited + (0.0 if back or drain else time.perf_counter() - started)
        fragment.pending = None
        optimizer_step(fragment.outer, fragment.synced, mean)
        with torch.no_grad():
            for parameter, synced in zip(fragment.parameters, fragment.synced, strict=True):
                parameter.copy_(synced.lerp(parameter, self.local_weight))
        self.outer_steps += 1
        return OuterUpdate(fragment.index, stats, float(torch.linalg.vector_norm(mean)), waited)

    def _figures(self, updates: list[OuterUpdate], step: int) -> AllReduceStats | None:
        """The step's all-reduce stats (several calls' added up), with the outer figures."""
        if not updates:
            return None
        last = updates[-1].stats
        every = [update.stats for update in updates]
        stats = last if len(updates) == 1 else AllReduceStats(
            last.collective, step, seconds=sum(s.seconds for s in every),
            bytes_sent=sum(s.bytes_sent for s in every),
            bytes_received=sum(s.bytes_received for s in every),
            coverage=min(s.coverage for s in every),
            peers_missing=tuple(sorted({p for s in every for p in s.peers_missing})),
            extra=dict(last.extra))
        stats.extra = {
            **stats.extra,
            "outer_step": float(self.outer_steps),
            "outer_updates": float(len(updates)),
            "pseudo_gradient_norm": math.sqrt(sum(u.norm ** 2 for u in updates)),
            "outer_wait_seconds": sum(u.waited for u in updates),
            **({"fragment": float(updates[-1].fragment)} if self.streaming else {}),
        }
        return stats

    def state(self) -> torch.Tensor:
        """The outer state as one flat vector on the host: the synced parameters, the outer
        momentum (zero before the first outer step: the same to SGD without dampening), the
        outer updates applied."""
        synced = [p for fragment in self.fragments for p in fragment.synced]
        momentum = [fragment.outer.state[p].get("momentum_buffer", torch.zeros_like(p))
                    for fragment in self.fragments for p in fragment.synced]
        return torch.cat([parameters_to_vector(synced).detach().cpu(),
                          parameters_to_vector(momentum).detach().cpu(),
                          torch.tensor([float(self.outer_steps)])])

    def restore(self, state: torch.Tensor) -> None:
        """Take `state` (another worker's `state()`): the synced parameters become this
        worker's parameters too, so it rejoins at the next outer step where the others are."""
        synced = [p for fragment in self.fragments for p in fragment.synced]
        size = sum(p.numel() for p in synced)
        if state.numel() != 2 * size + 1:
            raise ValueError(f"outer state: expected {2 * size + 1} values, got {state.numel()}")
        self.outer_steps = int(state[-1])
        state = state.to(synced[0])  # its dtype and device
        write_flat(state[:size], synced)
        momentum = [torch.empty_like(p) for p in synced]
        write_flat(state[size:2 * size], momentum)
        buffers = iter(momentum)
        for fragment in self.fragments:
            for p in fragment.synced:
                fragment.outer.state[p]["momentum_buffer"] = next(buffers)
            write_flat(parameters_to_vector(fragment.synced), fragment.parameters)
