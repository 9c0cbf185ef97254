"""Linear on CUDA: FP8 block weights on Triton, dense weights on cuBLAS, NVFP4 through the reference.

FP8 block (the official release: e4m3 weights, one fp32 multiplier per 128x128 block):
  - decode (at most DECODE_MAX_ROWS rows) reads the weight once and is bound by that read, so the
    fp8 tile is upcast in registers and multiplied with the activations as they are (W8A16, no
    activation error); the K loop is split over programs until every SM has work;
  - prefill is bound by math, so 16-bit activations are quantized per token per 128 columns
    (`activation_scheme: dynamic`) and fp8 x fp8 products run on the tensor cores, each 128-wide K
    step rescaled by activation scale x weight block scale into an fp32 accumulator;
  - fp32 activations (parity runs) take the W8A16 form at every size, with fp32-accurate dots.
The jitted helpers here (`quantize_tile`, `fp8_block_step`) are shared with the routed-expert kernels.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.linear.torch_ref import linear as torch_linear
from engine.kernels.token_variants import token_variants
from engine.quant import FP8_BLOCK
from engine.weights import Fp8BlockWeight, Weight

DECODE_MAX_ROWS = 16
QBLOCK = tl.constexpr(FP8_BLOCK[1])  # K width of a weight block, activation group and K step alike
FP8_MAX = tl.constexpr(448.0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs to fill. Triton's interpreter (CPU tensors) runs programs one after another, so it gets a
    small count: grids stay small while tiny shapes still take the split paths."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _e4m3_grid(v):
    """Round fp32 |v| <= 448 to the nearest e4m3 value (ties to even), still in fp32.

    Adding 1.5 * 2^(e+20) leaves the sum's last mantissa bit at v's e4m3 spacing 2^(e-3) (2^-9 for
    subnormals), so the fp32 add rounds exactly as the hardware's e4m3 conversion; the cast after it
    is then exact everywhere, Triton's interpreter (which truncates) included.
    """
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    shift = ((e + 147) << 23).to(tl.float32, bitcast=True) * 1.5
    return (v + shift) - shift


@triton.jit
def quantize_tile(v):
    """fp32 [R, C] -> (e4m3 [R, C], fp32 multiplier [R]); a row's amax maps to 448 (quant.quantize_fp8_block).

    Correctly rounded divisions keep the codes identical to the torch codec.
    """
    scale = tl.math.div_rn(tl.max(tl.abs(v), axis=1), FP8_MAX)
    scale = tl.where(scale > 0, scale, 1.0)
    q = _e4m3_grid(tl.clamp(tl.math.div_rn(v, scale[:, None]), -FP8_MAX, FP8_MAX))
    return q.to(tl.float8e4nv), scale


@triton.jit
def fp8_block_step(acc, a, a_scale_ptrs, a_ok, b, b_scale, A_FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a @ b for one 128-wide K step; b is an e4m3 [BK, BN] tile, b_scale its columns' block multipliers.

    With fp8 activations, one scaled product per step keeps the tensor cores' partial sums to 128 terms
    before they reach the fp32 accumulator. Otherwise the e4m3 tile is upcast (exactly) to a's 16-bit
    dtype, or both go to fp32 (fp32 activations, and the interpreter, whose tl.dot cannot multiply
    16-bit floats). There 3xTF32 is as accurate as fp32 FMAs on the tensor cores: an e4m3 value is
    exact in TF32, and a split into two TF32 halves keeps 22 of a's 24 significant bits.
    """
    if A_FP8:
        a_scale = tl.load(a_scale_ptrs, mask=a_ok, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
    elif DOT_F32:
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3") * b_scale[None, :]
    else:
        acc += tl.dot(a, b.to(a.dtype)) * b_scale[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])  # per-step counts: one build for all
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, BR: tl.constexpr):
    """Program (row tile, 128-column group): quantize it and write its per-row multipliers."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * QBLOCK + tl.arange(0, QBLOCK)
    rows64 = rows.to(tl.int64)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    v = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_tile(v)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rows64 * stride_s + tl.program_id(1), scale, mask=rows < M)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 multipliers [M, ceil(K/128)]): one scale per token per 128 columns."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, QBLOCK.value), dtype=torch.float32, device=x.device)
    br = 16
    _quantize_kernel[(triton.cdiv(m, br), s.shape[1])](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BR=br)
    return q, s


@triton.jit(do_not_specialize=["M"])  # per-step counts: one build for all
def _fp8_linear_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, out_ptr, M, N,
                       stride_a, stride_as, stride_w, stride_ws, stride_split, stride_out,
                       K: tl.constexpr, K_SPLIT: tl.constexpr, A_FP8: tl.constexpr, DOT_F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr):
    """Program (row tile, column tile, K split): out[split] tile = a @ w^T over K_SPLIT columns of K.

    K is a weight dim, so it is a compile-time constant like the tile shape (one build per weight shape).
    """
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    a_rows = a_ptr + rows64[:, None] * stride_a
    a_scales = a_s_ptr + rows64 * stride_as
    w_cols = w_ptr + cols64[None, :] * stride_w
    w_scales = w_s_ptr + (cols // QBLOCK) * stride_ws
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for step in range(0, K_SPLIT, QBLOCK):  # K_SPLIT is a multiple of QBLOCK
        k0 = split * K_SPLIT + step
        ks = k0 + tl.arange(0, QBLOCK)
        k_ok = ks < K
        # The last split's steps may run past K (steps do not always divide evenly): there no block scale exists,
        # so none is read (past a row's last, or the tensor's end) and the step adds 0.
        inside = k0 < K
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        b_scale = tl.load(w_scales + k0 // QBLOCK, mask=col_ok & inside, other=0.0)
        acc = fp8_block_step(acc, a, a_scales + k0 // QBLOCK, row_ok & inside, b, b_scale, A_FP8, DOT_F32)
    out = out_ptr + split.to(tl.int64) * stride_split + rows64[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dot_f32(x: torch.Tensor) -> bool:
    """Whether tl.dot without fp8 activations runs in fp32 (fp32 activations, or CPU tensors in the interpreter)."""
    return x.dtype == torch.float32 or not x.is_cuda


def _launch_shape(m: int, a_fp8: bool, f32: bool) -> tuple[int, int, int, int]:
    """(rows, columns, warps, stages) of one program's tile; fp32 dots need 8 warps to hold their operands."""
    if m <= DECODE_MAX_ROWS:
        return 16, 64, 8 if f32 else 4, 4  # tl.dot's smallest M; an 8 KiB fp8 weight tile per step
    if a_fp8:
        return (64 if m <= 64 else 128), 128, 8, 3
    return 64, 64, 8, 2


def _launch(m: int, n: int, k: int, f32: bool, sms: int) -> tuple[bool, int, int, int, int, int]:
    """(fp8 activations, rows, columns, warps, stages, K split) of the build and launch for x [m, k] @ w [n, k]^T.
    K is split only when the output tiles alone leave SMs idle (small N, or decode), aiming at two programs
    per SM."""
    a_fp8 = m > DECODE_MAX_ROWS and not f32
    bm, bn, warps, stages = _launch_shape(m, a_fp8, f32)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, QBLOCK.value)
    split = 1 if tiles >= sms else min(steps, triton.cdiv(2 * sms, tiles))
    return a_fp8, bm, bn, warps, stages, triton.cdiv(steps, split) * QBLOCK.value


_SHAPES_RUN: set[tuple[int, int, bool, int]] = set()  # (N, K, fp32 activations, SMs) of the linears run so far


@token_variants
def _builds(tokens: int) -> tuple:
    """The K split and tile a step of `tokens` rows takes in each linear run so far."""
    return tuple(_launch(tokens, *shape) for shape in sorted(_SHAPES_RUN))


def fp8_block_linear(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """x [M, K] (any M, incl. 1) @ dequantize(w)^T -> [M, N] in x's dtype."""
    assert w.block == FP8_BLOCK and w.data.stride(-1) == 1 and w.scale_inv.stride(-1) == 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.data.shape[0]
    shape = (n, k, x.dtype == torch.float32, sm_count(x.device))
    _SHAPES_RUN.add(shape)
    a_fp8, bm, bn, warps, stages, k_split = _launch(m, *shape)
    a, a_s = quantize_activations(x) if a_fp8 else (x, x)  # a_s is never read without fp8 activations
    split = triton.cdiv(k, k_split)
    out = torch.empty(split, m, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _fp8_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        a, a_s, w.data, w.scale_inv, out, m, n,
        a.stride(0), a_s.stride(0), w.data.stride(0), w.scale_inv.stride(0), out.stride(0), out.stride(1),
        K=k, K_SPLIT=k_split, A_FP8=a_fp8, DOT_F32=dot_f32(x), BM=bm, BN=bn,
        num_warps=warps, num_stages=stages)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


@register("linear", "triton")
def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    if not isinstance(weight, Fp8BlockWeight):
        return torch_linear(x, weight)  # dense: one cuBLAS matmul; NVFP4: dequantize until its kernel lands
    return fp8_block_linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
