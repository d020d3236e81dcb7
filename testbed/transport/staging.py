"""A tensor on any device, in host memory for the wire and back on its device afterwards.

The wire reads and writes host memory (numpy views of CPU tensors), so every collective takes
its input through `Staged`, works on `Staged.host` and returns `Staged.back(result)`: on the
input's device, in its dtype and shape. On the CPU both are views, no copy. A CUDA input is
copied into pinned memory with a non-blocking copy on the current stream (the copy engine
runs it beside the device's compute), which `Staged` waits for; `back` queues the copy to the
device on the current stream, where anything that later reads the result is ordered after it.

`Handover` carries a tensor from one thread to another (DDP's backward pass to the hook's
thread): there the work runs on a stream of its own that first waits for what the handing
thread had queued, so a bucket's copy to the host overlaps the backward pass, and the future
that brings the result back synchronises the stream that waits on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Staged:
    """`tensor`'s values as a flat, contiguous tensor in host memory (`host`), and the way
    back to where `tensor` was."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.input = tensor
        flat = tensor.detach().reshape(-1)
        self.on_host = flat.is_cpu
        if self.on_host:
            self.host = flat
        elif flat.is_cuda:
            self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(flat.device))
            copied.synchronize()
        else:
            self.host = flat.cpu()

    def writable(self) -> torch.Tensor:
        """The values in host memory that the caller may overwrite: a copy where `host` is
        the input's own memory, else `host` itself (a copy already; pinned for a CUDA input,
        so the result goes back from it without another)."""
        return self.host.clone() if self.on_host else self.host

    def back(self, result: torch.Tensor) -> torch.Tensor:
        """`result` (the input's number of elements, in host memory) shaped as the input, on
        its device and in its dtype: the same tensor where it is there already."""
        shaped = result.view_as(self.input)
        if self.on_host and shaped.dtype == self.input.dtype:  # no `to`: it costs microseconds
            return shaped
        return shaped.to(self.input.device, self.input.dtype, non_blocking=True)


class Handover:
    """A tensor handed to another thread: on a CUDA device, the point in the handing thread's
    stream that its values are ready at, and the device a future of its result lives on."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._ready: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))

    def future(self) -> torch.futures.Future:
        """A future for the result: with a CUDA tensor's device, so that waiting on it orders
        the waiter's stream after the work that made the result."""
        if self._ready is None:
            return torch.futures.Future()
        return torch.futures.Future(devices=[self.tensor.device])

    @contextmanager
    def received(self) -> Iterator[torch.Tensor]:
        """The tensor, in the receiving thread: on a CUDA device, within a stream of this call's
        own that first waits for the handing thread's work up to the handover (complete the
        future inside, so it records that stream)."""
        if self._ready is None:
            yield self.tensor
            return
        device = self.tensor.device
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            torch.cuda.current_stream(device).wait_event(self._ready)
            yield self.tensor
