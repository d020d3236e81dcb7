"""Group-wise INT8/INT4 quantization: symmetric or asymmetric, nearest or stochastic rounding,
INT4 packed two values per byte, all vectorised (no Python loop per element or group).

A flat fp32 vector of n values is cut into groups of `group` values (the last one padded with
zeros). Per group g:

- symmetric: scale_g = max|x| / qmax (qmax = 127 for INT8, 7 for INT4); q = round(x / scale_g)
  in [-qmax, qmax]; x' = q * scale_g.
- asymmetric: lo_g = min x, scale_g = (max x - lo_g) / (2^bits - 1); q = round((x - lo_g) /
  scale_g) in [0, 2^bits - 1]; x' = lo_g + q * scale_g.

Nearest rounding errs by at most scale_g / 2 per element, stochastic rounding (floor(y + u),
u ~ U[0, 1)) by less than scale_g, and is unbiased. On the wire a quantized vector is its
scales (fp32, one per group), for asymmetric its minima (fp32, one per group), then its codes
(one byte per value for INT8, one byte per two values for INT4): `wire_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (8, 4)


@dataclass(frozen=True)
class Format:
    """How values are quantized: `bits` (8 or 4), values per scale (`group`), symmetric or
    asymmetric, stochastic rounding or nearest."""

    bits: int = 8
    group: int = 128
    symmetric: bool = True
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits: expected one of 8, 4, got {self.bits}")
        if not 2 <= self.group <= 1 << 16 or self.group % 2:
            raise ValueError(f"group_size: expected an even number of values per scale "
                             f"(2..65536; 32-256 usual), got {self.group}")

    @property
    def levels(self) -> int:
        """Largest code: qmax (symmetric) or 2^bits - 1 (asymmetric)."""
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    def groups(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.group))

    def wire_size(self, numel: int) -> int:
        """Bytes of a quantized `numel`-value vector: scales, minima (asymmetric), codes."""
        groups = self.groups(numel)
        codes = groups * self.group // (8 // self.bits)
        return groups * 4 * (1 if self.symmetric else 2) + codes


@dataclass
class Quantized:
    """A quantized vector: per-group `scale` and `zero` (the minimum; zeros if symmetric) and
    the codes, one uint8 per value (unpacked; `pack` makes the wire bytes)."""

    fmt: Format
    numel: int
    scale: torch.Tensor  # (groups,) fp32
    zero: torch.Tensor  # (groups,) fp32
    codes: torch.Tensor  # (groups, group) uint8: q + offset (symmetric: q + qmax + 1 for INT4)


def _groups(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float32)
    groups = fmt.groups(flat.numel())
    if flat.numel() == groups * fmt.group:  # no padding: a view, no copy
        return flat.view(groups, fmt.group)
    padded = torch.zeros(groups * fmt.group, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(groups, fmt.group)


def _round(y: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    if stochastic:
        return torch.floor(y + torch.rand(y.shape, generator=generator))
    return torch.round(y)


def quantize(x: torch.Tensor, fmt: Format,
             generator: torch.Generator | None = None) -> Quantized:
    """`x` (any shape, read flat) group-wise quantized as `fmt` says."""
    g = _groups(x, fmt)
    if fmt.symmetric:
        zero = torch.zeros(g.shape[0])
        scale = g.abs().amax(dim=1) / fmt.levels
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round(g * inverse[:, None], fmt.stochastic, generator)
        offset = 128 if fmt.bits == 8 else 8  # codes stored unsigned
        codes = q.clamp_(-fmt.levels, fmt.levels).add_(offset).to(torch.uint8)
    else:
        zero = g.amin(dim=1)
        scale = (g.amax(dim=1) - zero) / fmt.levels
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = _round((g - zero[:, None]).mul_(inverse[:, None]), fmt.stochastic, generator)
        codes = q.clamp_(0, fmt.levels).to(torch.uint8)
    return Quantized(fmt, x.numel(), scale, zero, codes)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 values `q` stands for (flat, `q.numel` of them)."""
    fmt = q.fmt
    codes = q.codes.to(torch.float32)
    if fmt.symmetric:
        codes -= 128 if fmt.bits == 8 else 8
        values = codes.mul_(q.scale[:, None])
    else:
        values = codes.mul_(q.scale[:, None]).add_(q.zero[:, None])
    return values.reshape(-1)[: q.numel]


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (an even number of them, any shape) as bytes, two per byte: the first of
    each pair in the low nibble."""
    pairs = codes.reshape(-1, 2).to(torch.uint8)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack4` packed (flat, twice as many as bytes)."""
    packed = packed.reshape(-1)
    codes = torch.empty(2 * packed.numel(), dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=codes[0::2])
    torch.bitwise_right_shift(packed, 4, out=codes[1::2])
    return codes


def to_bytes(q: Quantized) -> torch.Tensor:
    """The wire bytes of `q` (uint8, `q.fmt.wire_size(q.numel)` of them)."""
    parts = [q.scale.to(torch.float32).view(torch.uint8)]
    if not q.fmt.symmetric:
        parts.append(q.zero.to(torch.float32).view(torch.uint8))
    codes = q.codes.reshape(-1)
    parts.append(pack4(codes) if q.fmt.bits == 4 else codes)
    return torch.cat(parts)


def from_bytes(data: torch.Tensor, numel: int, fmt: Format) -> Quantized:
    """The inverse of `to_bytes` for a `numel`-value vector quantized as `fmt`."""
    data = data.reshape(-1)
    if data.numel() != fmt.wire_size(numel):
        raise ValueError(f"quantized payload: expected {fmt.wire_size(numel)} bytes for "
                         f"{numel} values, got {data.numel()}")
    groups = fmt.groups(numel)
    scale = data[: 4 * groups].clone().view(torch.float32)
    at = 4 * groups
    if fmt.symmetric:
        zero = torch.zeros(groups)
    else:
        zero = data[at: at + 4 * groups].clone().view(torch.float32)
        at += 4 * groups
    codes = data[at:]
    if fmt.bits == 4:
        codes = unpack4(codes)
    return Quantized(fmt, numel, scale, zero, codes.reshape(groups, fmt.group))


def error_bound(q: Quantized) -> torch.Tensor:
    """Per group, the most an element can be off: scale / 2 (nearest), scale (stochastic)."""
    return q.scale * (1.0 if q.fmt.stochastic else 0.5)
