"""In-memory weight formats: a linear weight is one of these objects, attached to the layer that uses it.

Quantized weights stay packed (a 181 GiB NVFP4 checkpoint must never be expanded to bf16);
`dequantize` expands only what one op needs. Stacked forms (a leading expert dim) index with
`weight[e]` so the expert code never branches on the format.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Union

import torch

from engine.quant import FP8_BLOCK, dequantize_fp8_block, dequantize_nvfp4


@dataclass
class DenseWeight:
    """A plain weight [..., N, K] already in the compute dtype."""

    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.data.to(dtype)

    def __getitem__(self, index: int | torch.Tensor) -> "DenseWeight":
        return DenseWeight(self.data[index])

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class Fp8BlockWeight:
    """float8_e4m3fn [..., N, K] with one fp32 multiplier per (bn x bk) block (official FP8 release)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = FP8_BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.data, self.scale_inv, self.block, dtype)

    def __getitem__(self, index: int | torch.Tensor) -> "Fp8BlockWeight":
        return Fp8BlockWeight(self.data[index], self.scale_inv[index], self.block)

    def nbytes(self) -> int:
        return self.data.numel() + self.scale_inv.numel() * 4


@dataclass
class Nvfp4Weight:
    """E2M1 codes packed two per byte [..., N, K/2], e4m3 scales per 16 [..., N, K/16], fp32 global multiplier.

    `global_scale` is [..., 1] or [..., N]; compressed-tensors' divisor is inverted at load so every
    NVFP4 checkpoint flavour reaches the kernels in one convention.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.global_scale, dtype)

    def __getitem__(self, index: int | torch.Tensor) -> "Nvfp4Weight":
        return Nvfp4Weight(self.packed[index], self.scale[index], self.global_scale[index])

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() + self.global_scale.numel() * 4


Weight = Union[DenseWeight, Fp8BlockWeight, Nvfp4Weight]


@dataclass
class SplitStack:
    """A stack of routed experts [E, ...] held in two places: experts [0, S) in `device` (device memory), the
    others in `host` (host RAM), whose last `spare` entries hold no expert (room a swap copies into: see
    engine/experts/hybrid.py). Hybrid offload's initial placement, made while loading, so the full stack
    never sits in one place."""

    device: Weight
    host: Weight
    spare: int = 0

    @property
    def slots(self) -> int:
        return self.device.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.slots + self.host.shape[0] - self.spare, *self.device.shape[1:])

    @property
    def hosted(self) -> Weight:
        """The host part without its spare entries: experts [S, E) in order."""
        return map_tensors(self.host, lambda t: t[:t.shape[0] - self.spare])

    def nbytes(self) -> int:
        return self.device.nbytes() + self.host.nbytes()


def stack_format(stack: "Weight | SplitStack") -> type:
    """The weight type an expert stack stores its experts in, split between two places or not."""
    return type(stack.host if isinstance(stack, SplitStack) else stack)


def tensor_fields(weight: Weight) -> tuple[str, ...]:
    """The names of a weight's tensors, in a fixed order."""
    return {DenseWeight: ("data",), Fp8BlockWeight: ("data", "scale_inv"),
            Nvfp4Weight: ("packed", "scale", "global_scale")}[type(weight)]


def map_tensors(weight: Weight, fn) -> Weight:
    """The same weight with `fn` applied to each of its tensors (a gather, a move, pinning)."""
    out = copy.copy(weight)
    for name in tensor_fields(weight):
        setattr(out, name, fn(getattr(weight, name)))
    return out


def stack_rows(parts: list[Weight]) -> Weight | None:
    """The parts' output rows stacked into one weight of the same format, or None where they cannot be:
    mixed formats, 16-bit dtypes that differ, or an FP8 part (not the last) whose rows end inside a block."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts) or len({p.shape[-1] for p in parts}) != 1:
        return None
    if kind is DenseWeight:
        if len({p.data.dtype for p in parts}) != 1:
            return None
        return DenseWeight(torch.cat([p.data for p in parts], dim=-2))
    if kind is Fp8BlockWeight:
        if len({p.block for p in parts}) != 1 or any(p.shape[-2] % p.block[0] for p in parts[:-1]):
            return None
        return Fp8BlockWeight(torch.cat([p.data for p in parts], dim=-2),
                              torch.cat([p.scale_inv for p in parts], dim=-2), parts[0].block)
    rows = [p.global_scale.expand(p.shape[-2]) if p.global_scale.numel() == 1 else p.global_scale for p in parts]
    return Nvfp4Weight(torch.cat([p.packed for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                       torch.cat(rows, dim=-1))


def row_slice(weight: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of a 2-D weight as views (FP8: `start` on a block boundary)."""
    if isinstance(weight, DenseWeight):
        return DenseWeight(weight.data[start:stop])
    if isinstance(weight, Fp8BlockWeight):
        bn = weight.block[0]
        return Fp8BlockWeight(weight.data[start:stop], weight.scale_inv[start // bn: -(-stop // bn)], weight.block)
    return Nvfp4Weight(weight.packed[start:stop], weight.scale[start:stop], weight.global_scale[start:stop])
