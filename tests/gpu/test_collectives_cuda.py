"""Every collective with CUDA tensors (tier gpu: skipped where CUDA is missing): the result
comes back on the input's device, in its dtype and shape, and equals what the same call gives
for the input on the CPU (the exact collectives exactly). The copy to the host goes through
pinned memory; gloo needs a process per rank."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from loopback import KINDS, allreduce, free_ports, group, spawn

from testbed.collectives import create
from testbed.collectives.lab import run_concurrently
from testbed.transport.staging import Staged

pytestmark = pytest.mark.gpu
WORLD = 2
EXACT = ("ring", "ring+int8")  # the same input gives bitwise the same result
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Each worker's input: a transposed matrix (not contiguous, as a gradient view may be)."""
    return [torch.randn(211, 173, generator=torch.Generator().manual_seed(rank)).to(dtype).t()
            for rank in range(WORLD)]


def test_a_cuda_tensor_is_staged_in_pinned_memory_and_comes_back():
    tensor = torch.randn(1000, 3, device="cuda")
    staged = Staged(tensor)
    assert staged.host.is_pinned() and torch.equal(staged.host, tensor.cpu().reshape(-1))
    back = staged.back(staged.writable() * 2)
    torch.cuda.current_stream().synchronize()
    assert back.device == tensor.device and torch.equal(back, tensor * 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_input_comes_back_on_cuda_as_the_cpu_result(kind, dtype):
    given = inputs(dtype)
    with group(kind, WORLD) as collectives:
        on_cpu = allreduce(collectives, given, step=0)
    with group(kind, WORLD) as collectives:  # afresh: compressors keep state between calls
        on_cuda = allreduce(collectives, [tensor.cuda() for tensor in given], step=0)
    for tensor, (cpu, cpu_stats), (gpu, gpu_stats) in zip(given, on_cpu, on_cuda, strict=True):
        assert gpu.device.type == "cuda" and gpu.dtype == dtype and gpu.shape == tensor.shape
        assert cpu_stats.coverage == gpu_stats.coverage == 1.0
        if kind in EXACT:
            assert torch.equal(gpu.cpu(), cpu), kind
        else:
            torch.testing.assert_close(gpu.cpu(), cpu)


def test_the_sharded_step_returns_the_parameters_on_cuda():
    parameters = torch.randn(10_001, generator=torch.Generator().manual_seed(7))
    gradients = [torch.randn(10_001, generator=torch.Generator().manual_seed(r))
                 for r in range(WORLD)]

    def update(start: int, values: torch.Tensor, averaged: torch.Tensor) -> torch.Tensor:
        assert values.device.type == "cpu"  # the owners' optimizer works on the host
        return values - 0.1 * averaged

    def step_all(device: str) -> list:
        with group("lossy", WORLD) as lossy:
            return run_concurrently(*(
                partial(worker.step, parameters.to(device), gradient.to(device), 0, update)
                for worker, gradient in zip(lossy, gradients, strict=True)))

    for (cpu, _), (gpu, stats) in zip(step_all("cpu"), step_all("cuda"), strict=True):
        assert gpu.device.type == "cuda" and stats.coverage == 1.0
        torch.testing.assert_close(gpu.cpu(), cpu)


def gloo_worker(rank: int, port: int, results) -> None:
    gloo = create("gloo", rank, WORLD, master=("127.0.0.1", port), timeout=60)
    try:
        given = inputs(torch.float32)[rank]
        on_cpu, _ = gloo.allreduce(given, 0)
        on_cuda, _ = gloo.allreduce(given.cuda(), 1)
        results.put((rank, on_cuda.device.type, on_cuda.shape == given.shape,
                     torch.equal(on_cuda.cpu(), on_cpu)))
    finally:
        gloo.close()


def test_gloo_with_cuda_input_returns_on_cuda_the_cpu_result():
    for _, device, same_shape, equal in spawn(gloo_worker, WORLD, free_ports(1)[0]):
        assert device == "cuda" and same_shape and equal
