"""Pure tensor codecs for the quantized weight formats: FP8 128x128 blocks and NVFP4 (E2M1 + FP8 group scales).

Shared by the in-memory weights (engine/weights.py), the kernels and the tiny model's factory. No model
knowledge lives here: the loader decides which tensors are which and, for NVFP4, converts the global scale
to a multiplier (compressed-tensors stores a divisor, ModelOpt a multiplier).
All math runs in float32 with plain torch ops, so every function works on CPU and CUDA alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_BLOCK: tuple[int, int] = (128, 128)
NVFP4_GROUP = 16
FP8_CACHE_GROUP = 128  # elements of a cached vector per fp32 scale (a 512-wide latent: 4 scales, as vLLM's fp8_ds_mla)

_FP8_MAX = 448.0
_E2M1_MAX = 6.0
# Code -> value; bit 3 is the sign, so code 8 is -0.0.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32)
# Midpoints between neighbouring magnitudes. A tie goes to the even code (mantissa bit 0), as in
# compressed-tensors' cast_to_fp4: ties at these midpoints round down ...
_E2M1_TIES_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0])
# ... and ties at these round up.
_E2M1_TIES_UP = torch.tensor([0.75, 1.75, 3.5])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K]; byte j holds element 2j in its low nibble, 2j+1 in its high one."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return _E2M1_TABLE.to(packed.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., K] -> uint8 [..., K/2], the inverse of `unpack_e2m1`'s nibble order."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Round values (already divided by their scale) to the nearest E2M1 code, ties to even; saturates at 6."""
    magnitude = values.float().abs()
    down = _E2M1_TIES_DOWN.to(values.device)
    up = _E2M1_TIES_UP.to(values.device)
    # Index of the magnitude = how many midpoints lie below it (strictly for ties-down, inclusively for ties-up).
    index = torch.bucketize(magnitude, down, right=False) + torch.bucketize(magnitude, up, right=True)
    sign = (values < 0).to(torch.uint8) << 3
    return index.to(torch.uint8) | sign


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Repeat a per-block scale [..., ceil(rows/bn), ceil(cols/bk)] to [..., rows, cols], cropping ragged last blocks."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """float8_e4m3fn [..., N, K] times its per-block `scale_inv` [..., ceil(N/bn), ceil(K/bk)] (a multiplier)."""
    rows, cols = weight.shape[-2:]
    scale = _expand_blocks(scale_inv.float(), block, rows, cols)
    return (weight.float() * scale).to(dtype)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """E2M1 [..., N, K/2] x fp8 group scale [..., N, K/16] x global multiplier [..., 1] or per row [..., N] -> [..., N, K].

    A per-row global lets gate and up rows that were quantized with different globals share one stacked matrix.
    """
    values = unpack_e2m1(packed).unflatten(-1, (-1, NVFP4_GROUP))
    group_scale = scale.float() * global_scale.float().unsqueeze(-1)
    return (values * group_scale.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]); block amax maps to 448."""
    bn, bk = block
    rows, cols = weight.shape[-2:]
    w = weight.float()
    padded = F.pad(w, (0, -cols % bk, 0, -rows % bn))
    blocks = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    scale_inv = blocks.abs().amax(dim=(-3, -1)) / _FP8_MAX
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))  # all-zero block
    q = (w / _expand_blocks(scale_inv, block, rows, cols)).clamp(-_FP8_MAX, _FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def quantize_fp8_groups(x: torch.Tensor, group: int = FP8_CACHE_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] float -> (float8_e4m3fn [..., D], scale fp32 [..., D / group]); each group's amax maps to 448.
    Vectors written to a cache one at a time: a token's scales never depend on another token."""
    groups = x.float().unflatten(-1, (-1, group))
    scale = groups.abs().amax(dim=-1, keepdim=True) / _FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    codes = (groups / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scale.squeeze(-1)


def dequantize_fp8_groups(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_fp8_groups`: codes [..., D], scale [..., D / group] -> [..., D] in `dtype`."""
    groups = codes.float().unflatten(-1, (scale.shape[-1], -1))
    return (groups * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 16 == 0) -> (packed uint8 [N, K/2], fp8 scale [N, K/16], global multiplier fp32 [1]).

    The global maps the tensor amax to the largest fp8 scale times the largest E2M1 value, so group
    scales use the whole e4m3 range; dequantize with `dequantize_nvfp4(packed, scale, global)`.
    """
    w = weight.float()
    global_scale = (w.abs().amax() / (_FP8_MAX * _E2M1_MAX)).reshape(1)
    global_scale = torch.where(global_scale > 0, global_scale, torch.ones_like(global_scale))
    groups = w.unflatten(-1, (-1, NVFP4_GROUP))
    group_amax = groups.abs().amax(dim=-1)
    scale = (group_amax / _E2M1_MAX / global_scale).clamp(max=_FP8_MAX).to(torch.float8_e4m3fn)
    step = scale.float() * global_scale
    step = torch.where(step > 0, step, torch.ones_like(step))  # zero scale: avoid 0/0, dequantizes to 0 anyway
    codes = e2m1_codes(groups / step.unsqueeze(-1)).flatten(-2)
    return pack_e2m1(codes), scale, global_scale
