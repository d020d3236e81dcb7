"""Tensors on any device through the collectives (`testbed.transport.staging`), checked where
there is no GPU: the CPU path copies nothing it did not copy before, the wire refuses memory it
cannot read, and every collective returns its result in the input's dtype (float16, bfloat16)
and shape. tests/gpu runs the same calls with CUDA tensors."""

from __future__ import annotations

import pytest
import torch
from loopback import KINDS, allreduce, group

from testbed.collectives.lossy import collective as lossy_collective
from testbed.transport.staging import Handover, Staged
from testbed.transport.tensors import as_bytes

WORLD = 2


def test_a_cpu_tensor_is_used_in_place_and_comes_back_as_it_was():
    tensor = torch.randn(3, 4)
    staged = Staged(tensor)
    assert staged.host.data_ptr() == tensor.data_ptr() and staged.host.shape == (12,)
    writable = staged.writable()
    writable.add_(1.0)  # a copy: the caller's tensor stays as it was
    assert writable.data_ptr() != tensor.data_ptr() and not torch.equal(writable.view(3, 4),
                                                                        tensor)
    back = staged.back(writable)
    assert back.data_ptr() == writable.data_ptr() and back.shape == (3, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_result_comes_back_in_the_inputs_dtype(dtype):
    staged = Staged(torch.ones(2, 3, dtype=dtype))
    back = staged.back(torch.full((6,), 0.5, dtype=torch.float32))
    assert back.dtype == dtype and back.shape == (2, 3) and torch.all(back == 0.5)


def test_the_wire_refuses_memory_it_cannot_read():
    with pytest.raises(ValueError, match=r"tensor: on meta; the wire reads and writes host"):
        as_bytes(torch.empty(4, device="meta"))


def test_a_cpu_handover_is_the_tensor_itself():
    tensor = torch.arange(4.0)
    handover = Handover(tensor)
    future = handover.future()
    with handover.received() as received:
        assert received is tensor
        future.set_result(received * 2)
    assert torch.equal(future.wait(), tensor * 2)


def test_lossy_sends_from_the_callers_own_memory(monkeypatch):
    """No copy on the CPU path: the call's contribution is the input's memory."""
    seen: list[int] = []

    class Spy(lossy_collective.Call):
        def __init__(self, lossy, contribution, *args) -> None:
            seen.append(contribution.data_ptr())
            super().__init__(lossy, contribution, *args)

    monkeypatch.setattr(lossy_collective, "Call", Spy)
    inputs = [torch.randn(1000) for _ in range(WORLD)]
    with group("lossy", WORLD) as lossy:
        allreduce(lossy, inputs, step=0)
    assert sorted(seen) == sorted(tensor.data_ptr() for tensor in inputs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_collective_returns_the_inputs_dtype_and_shape(kind, dtype):
    inputs = [torch.randn(40, 50, generator=torch.Generator().manual_seed(rank)).to(dtype)
              for rank in range(WORLD)]
    mean = torch.stack([tensor.float() for tensor in inputs]).mean(0)
    with group(kind, WORLD) as collectives:
        results = allreduce(collectives, inputs, step=0)
    for tensor, (result, stats) in zip(inputs, results, strict=True):
        assert result.dtype == dtype and result.shape == tensor.shape, kind
        assert stats.coverage == 1.0
        if "+" not in kind:  # compressors are inexact by design
            torch.testing.assert_close(result.float(), mean, rtol=0.02, atol=0.02)
