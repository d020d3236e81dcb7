"""Tensors as wire bytes and back, without copies where the memory allows it."""

from __future__ import annotations

import numpy as np
import torch

from testbed.transport.wire import Codec

_DTYPES = {
    Codec.BYTES: torch.uint8,
    Codec.FLOAT32: torch.float32,
    Codec.FLOAT16: torch.float16,
    Codec.BFLOAT16: torch.bfloat16,
    Codec.INT8: torch.int8,
}
_CODECS = {dtype: codec for codec, dtype in _DTYPES.items()}
# Same-size integer types, to move any codec's elements as bits (numpy has no bfloat16).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_NUMPY_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}
_NUMPY_VALUES = {Codec.BYTES: np.uint8, Codec.FLOAT32: np.float32, Codec.FLOAT16: np.float16,
                 Codec.INT8: np.int8}


def dtype_of(codec: int) -> torch.dtype:
    return _DTYPES[Codec(codec)]


def codec_of(dtype: torch.dtype) -> Codec:
    try:
        return _CODECS[dtype]
    except KeyError:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _CODECS)
        raise ValueError(f"dtype: {dtype} has no wire codec; allowed: {allowed}") from None


def as_bytes(tensor: torch.Tensor | np.ndarray) -> tuple[Codec, memoryview]:
    """The tensor's codec and its raw bytes (a view, no copy, for contiguous tensors). Only
    host memory is read or written here: a tensor on another device is refused, not copied
    (a copy would take a received message in place of `out`); the collectives bring theirs to
    the host and back through `staging.Staged`."""
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor: on {tensor.device}; the wire reads and writes host memory "
                         "(bring it there with testbed.transport.staging.Staged)")
    values = tensor.detach().reshape(-1)
    codec = codec_of(values.dtype)
    return codec, memoryview(values.view(torch.uint8).numpy())


def bits(tensor: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a contiguous tensor's elements as same-size integers."""
    if not tensor.is_contiguous():
        raise ValueError("out: needs a contiguous tensor")
    return tensor.view(-1).view(_BITS[tensor.element_size()]).numpy()


def bits_dtype(itemsize: int) -> np.dtype:
    """The numpy integer type `bits` gives for elements of `itemsize` bytes."""
    return _NUMPY_BITS[itemsize]


def values_of(elements: np.ndarray, codec: Codec) -> np.ndarray:
    """Elements given as bits (`bits_dtype`) as numbers numpy can add: bfloat16, which numpy
    lacks, widened to float32 (its bits are float32's upper half)."""
    if codec is Codec.BFLOAT16:
        return (elements.astype(np.uint32) << 16).view(np.float32)
    return elements.view(_NUMPY_VALUES[codec])
