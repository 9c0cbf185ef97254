"""Weight-tile decoding inside the expert kernels, written once for the decode GEMV and the prefill GEMM.

NVFP4 stacks reach the kernels as int32 words, eight E2M1 codes per word with the lowest nibble in
the lowest column, so one 16-byte load brings 32 weights. A code becomes an exact float without a
table: its three magnitude bits move to the low exponent bits and top mantissa bit of an fp16, its
sign bit to the fp16 sign. That fp16 is the E2M1 value times 2**-14 (the codes +-0.5 are fp16
subnormals, which the fp16->fp32 conversion keeps exact, whereas fp32 subnormals may be flushed).
Codes c and c+4 of a word are built together in one 32-bit register (two fp16 halves), which leaves
a word's values in "code order" (columns 0 4 2 6 1 5 3 7: the column's 3 low bits reversed), so
activations meet NVFP4 weights in that order too (`to_code_order`, `code_position`): any order is
fine for a dot product as long as both sides share it, and this one costs no shuffles.
The 2**14 is folded into the per-16 group scale; the per-expert (or per-row) global multiplies the
accumulator once after the K loop. Dense stacks take the same entry points with FP4=False (natural
column order), so each kernel is written once for both formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.weights import DenseWeight, Nvfp4Weight

E2M1_UNIT = tl.constexpr(16384.0)  # 2**14, undoes the fp16 placement in `e2m1_values`
_MAGNITUDES = tl.constexpr(0x0E000E00)  # code bits 0-2 of two codes, at fp16 bits 9-11 of each half
_SIGNS = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32: code bit 3 at each half's sign bit


@dataclass(frozen=True)
class StackOperands:
    """One expert stack as kernel arguments: (weights, scales, globals, FP4) and element strides.

    For NVFP4, `weights` is the packed stack viewed as int32 words [E, N, K/8]; for a dense stack it
    is the data itself, and `scales`/`globals_` alias it with zero strides (the kernels never read them).
    """

    weights: torch.Tensor
    scales: torch.Tensor
    globals_: torch.Tensor
    fp4: bool
    stride_we: int
    stride_wn: int
    stride_se: int
    stride_sn: int
    stride_ge: int
    stride_gn: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weights, self.scales, self.globals_

    def strides(self) -> tuple[int, int, int, int, int, int]:
        return self.stride_we, self.stride_wn, self.stride_se, self.stride_sn, self.stride_ge, self.stride_gn


def stack_operands(stack: DenseWeight | Nvfp4Weight) -> StackOperands:
    if isinstance(stack, Nvfp4Weight):
        if stack.packed.stride(-1) != 1 or stack.scale.stride(-1) != 1:
            raise ValueError("NVFP4 expert stacks need contiguous rows")
        words = stack.packed.view(torch.int32)
        glob = stack.global_scale.reshape(stack.packed.shape[0], -1)  # [E, 1] or per row [E, N]
        per_row = glob.shape[1] != 1
        return StackOperands(words, stack.scale, glob, True, words.stride(0), words.stride(1),
                             stack.scale.stride(0), stack.scale.stride(1), glob.stride(0),
                             glob.stride(1) if per_row else 0)
    if isinstance(stack, DenseWeight):
        data = stack.data
        if data.stride(-1) != 1:
            raise ValueError("dense expert stacks need contiguous rows")
        return StackOperands(data, data, data, False, data.stride(0), data.stride(1), 0, 0, 0, 0)
    raise TypeError(f"no Triton expert kernel for {type(stack).__name__}")


def paired_operands(gate: DenseWeight | Nvfp4Weight,
                    up: DenseWeight | Nvfp4Weight) -> tuple[StackOperands, StackOperands]:
    """Gate and up share one launch, so they must share format, shape and strides."""
    g, u = stack_operands(gate), stack_operands(up)
    if type(gate) is not type(up) or gate.shape != up.shape or g.strides() != u.strides():
        raise ValueError("gate and up stacks must have the same format, shape and layout")
    return g, u


def to_code_order(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., K] -> a copy in `dtype` whose every 8 columns are in code order, to meet NVFP4 weights."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    words = (*x.shape[:-1], x.shape[-1] // 8, 2, 2, 2)
    out.view(words).copy_(x.reshape(words).transpose(-1, -3))  # reversing the bits of a column = its axes
    return out


@triton.jit
def code_position(cols):
    """Where column `cols` sits in code order (its 3 low bits reversed; the order is its own inverse)."""
    return (cols & ~7) | ((cols & 1) << 2) | (cols & 2) | ((cols >> 2) & 1)


@triton.jit
def _fp16_pair(words, MAGNITUDE_SHIFT: tl.constexpr):
    """Codes c and c+4 (c = (9 - MAGNITUDE_SHIFT) / 4) of each word as two fp16 halves of an int32."""
    if MAGNITUDE_SHIFT > 0:
        magnitudes = words << MAGNITUDE_SHIFT
    else:
        magnitudes = words >> -MAGNITUDE_SHIFT
    if MAGNITUDE_SHIFT == -3:
        signs = words  # code 3's sign bit already is bit 15
    else:
        signs = words << (MAGNITUDE_SHIFT + 3)
    return (magnitudes & _MAGNITUDES) | (signs & _SIGNS)


@triton.jit
def e2m1_values(words):
    """int32 [R, W] -> float32 [R, W * 8]: each word's codes in code order, times 2**-14.

    Codes c and c+4 sit 16 bits apart, so one shift-and-mask builds both fp16s; the joins keep every
    new axis in a thread's registers, and code order is just their nesting.
    """
    low = tl.join(_fp16_pair(words, 9), _fp16_pair(words, 5))  # [R, W, 2]: codes 0, 1 (+4)
    high = tl.join(_fp16_pair(words, 1), _fp16_pair(words, -3))  # codes 2, 3 (+4)
    halves = tl.join(low, high)  # [R, W, 2, 2]
    values = tl.join(halves.to(tl.int16), (halves >> 16).to(tl.int16))  # [R, W, 2, 2, 2]
    values = values.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.reshape(values, (words.shape[0], words.shape[1] * 8))


@triton.jit
def group_scales(s_ptr, rows, k0, stride_sn, BLOCK_K: tl.constexpr):
    """The fp8 scales of `rows` for columns k0 .. k0+BLOCK_K: float32 [R, BLOCK_K/16], times 2**14."""
    groups = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    return tl.load(s_ptr + rows[:, None] * stride_sn + groups[None, :]).to(tl.float32) * E2M1_UNIT


@triton.jit
def gemv_partial(w_ptr, s_ptr, rows, k0, x, stride_wn, stride_sn, FP4: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-16-column partial dot products of `rows` with x [BLOCK_K] (fp32; code order for NVFP4): [R, BLOCK_K/16].

    Summing the columns is left to the caller, after the K loop, so the loop has no cross-lane reduction.
    """
    n_rows: tl.constexpr = rows.shape[0]
    groups: tl.constexpr = BLOCK_K // 16
    if FP4:
        words = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
        values = tl.reshape(e2m1_values(words), (n_rows, groups, 16))
        partial = tl.sum(values * tl.reshape(x, (groups, 16))[None, :, :], axis=2)
        return partial * group_scales(s_ptr, rows, k0, stride_sn, BLOCK_K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.float32)
    return tl.sum(tl.reshape(w * x[None, :], (n_rows, groups, 16)), axis=2)


@triton.jit
def weight_tile(w_ptr, s_ptr, rows, k0, stride_wn, stride_sn,
                FP4: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """Rows x columns k0 .. k0+BLOCK_K of one expert's weight in DTYPE (code order for NVFP4), global not applied.

    For NVFP4 in bf16 the tile is exact: an E2M1 value times an e4m3 scale has at most 6 significant bits.
    """
    if FP4:
        n_rows: tl.constexpr = rows.shape[0]
        words = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
        values = tl.reshape(e2m1_values(words), (n_rows, BLOCK_K // 16, 16))
        scaled = values * group_scales(s_ptr, rows, k0, stride_sn, BLOCK_K)[:, :, None]
        return tl.reshape(scaled, (n_rows, BLOCK_K)).to(DTYPE)
    return tl.load(w_ptr + rows[:, None] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(DTYPE)


@triton.jit
def global_multiplier(g_ptr, rows, stride_gn, FP4: tl.constexpr):
    """The NVFP4 global of each row (stride 0 for one global per expert); 1 for dense stacks."""
    ptrs = g_ptr + rows * stride_gn  # both branches return its (broadcast) shape
    if FP4:
        return tl.load(ptrs)
    return tl.full(ptrs.shape, 1.0, tl.float32)
