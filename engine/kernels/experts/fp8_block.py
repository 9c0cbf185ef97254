"""Routed experts in FP8 blocks (e4m3, one fp32 multiplier per 128x128) on Triton, equal to TorchExperts.

Decode (at most DECODE_MAX_TOKENS tokens) is bound by reading the selected experts' weights, so it
runs as two GEMV launches over the (token, expert) pairs: gate+up with the clamped SwiGLU fused,
then down with the routing weight and the sum over the token's k experts fused, each program
covering a slice of rows sized so the launch fills the SMs at batch 1. Shapes alone decide the
launches (no host sync), so decode is CUDA-graph capturable.

Prefill sorts the pairs by expert on the device (`align_by_expert`) and runs grouped GEMMs over
row blocks of one expert on the FP8 tensor cores: 16-bit activations are quantized per token per
128 columns, the gate/up epilogue quantizes its SwiGLU output the same way for down, and each
128-wide K step is rescaled by activation scale x weight block scale. fp32 activations keep full
precision instead (e4m3 tiles upcast, fp32-accurate products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.experts.epilogue import clamped_swiglu
from engine.kernels.experts.prefill import align_by_expert, sorted_block
from engine.kernels.linear.triton_linear import (
    QBLOCK, dot_f32, fp8_block_step, quantize_activations, quantize_tile, sm_count,
)
from engine.quant import FP8_BLOCK
from engine.weights import Fp8BlockWeight

DECODE_MAX_TOKENS = 16
_GEMV_TILE = 8192  # weight elements a GEMV program loads per step and matrix (rows x columns)
_TILE_ROWS = 64  # pairs per grouped-GEMM row block: about the tokens one expert gets in a 2k-token prefill


@triton.jit
def _gate_up_gemv(x_ptr, ids_ptr, rw_ptr, gw_ptr, gs_ptr, uw_ptr, us_ptr, h_ptr, I, limit,
                  stride_x, stride_we, stride_wn, stride_se, stride_sn,
                  D: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (pair, row slice): h[pair, rows] = swiglu(gate_e x, up_e x) over BN rows of I; BN divides 128.
    A pair of routing weight zero (a hybrid step's pair whose expert is elsewhere) reads and writes nothing."""
    pair = tl.program_id(0)
    if tl.load(rw_ptr + pair) == 0:
        return
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < I
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    w_rows = expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    s_row = expert * stride_se + (tl.program_id(1) * BN // QBLOCK) * stride_sn  # one block row per slice
    g = tl.zeros([BN], dtype=tl.float32)
    u = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < D
        ok = row_ok[:, None] & col_ok[None, :]
        xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        wg = tl.load(gw_ptr + w_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        wu = tl.load(uw_ptr + w_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sg = tl.load(gs_ptr + s_row + cols // QBLOCK, mask=col_ok, other=0.0)
        su = tl.load(us_ptr + s_row + cols // QBLOCK, mask=col_ok, other=0.0)
        g += tl.sum(wg * (xv * sg)[None, :], axis=1)
        u += tl.sum(wu * (xv * su)[None, :], axis=1)
    tl.store(h_ptr + pair.to(tl.int64) * I + rows, clamped_swiglu(g, u, limit), mask=row_ok)


@triton.jit
def _down_gemv(h_ptr, ids_ptr, rw_ptr, dw_ptr, ds_ptr, out_ptr, D,
               stride_we, stride_wn, stride_se, stride_sn, stride_out,
               I: tl.constexpr, TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (token, row slice): out[token, rows] = sum_j weight_j * down_e_j h_j over BN rows of D, the pairs of
    weight zero skipped."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < D
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in range(TOPK):
        pair = token * TOPK + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(rw_ptr + pair)
        if weight != 0:
            w_rows = expert * stride_we + rows64[:, None] * stride_wn
            s_row = expert * stride_se + (tl.program_id(1) * BN // QBLOCK) * stride_sn
            h_row = h_ptr + pair.to(tl.int64) * I
            for k0 in range(0, I, BK):
                cols = k0 + tl.arange(0, BK)
                col_ok = cols < I
                hv = tl.load(h_row + cols, mask=col_ok, other=0.0)
                s = tl.load(ds_ptr + s_row + cols // QBLOCK, mask=col_ok, other=0.0)
                w = tl.load(dw_ptr + w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * (hv * (s * weight))[None, :], axis=1)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["pairs", "experts"])  # per-step counts: one build for all
def _gate_up_grouped(a_ptr, a_s_ptr, rows_ptr, block_expert_ptr, gw_ptr, gs_ptr, uw_ptr, us_ptr, h_ptr, h_s_ptr,
                     I, pairs, experts, limit,
                     stride_a, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs,
                     D: tl.constexpr, TOPK: tl.constexpr, A_FP8: tl.constexpr, DOT_F32: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
    """Program (row block of one expert, column block): h[pair] = swiglu(gate_e x[token], up_e x[token]).

    With fp8 activations h is quantized per 128 columns on the way out (then BN == 128: one scale per
    row per program), ready for the down GEMM.
    """
    block = tl.program_id(0)
    expert, pair, row_ok = sorted_block(rows_ptr, block_expert_ptr, block, pairs, BM)
    if expert >= experts:  # a padding block past the last expert's rows
        return
    tokens = (tl.where(row_ok, pair, 0) // TOPK).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < I
    a_rows = a_ptr + tokens[:, None] * stride_a
    a_scales = a_s_ptr + tokens * stride_as
    w_cols = expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    s_cols = expert * stride_se + (cols // QBLOCK) * stride_sn
    g = tl.zeros([BM, BN], dtype=tl.float32)
    u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, QBLOCK):
        ks = k0 + tl.arange(0, QBLOCK)
        k_ok = ks < D
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & col_ok[None, :]
        bg = tl.load(gw_ptr + w_cols + ks[:, None], mask=b_ok, other=0.0)
        bu = tl.load(uw_ptr + w_cols + ks[:, None], mask=b_ok, other=0.0)
        sg = tl.load(gs_ptr + s_cols + k0 // QBLOCK, mask=col_ok, other=0.0)
        su = tl.load(us_ptr + s_cols + k0 // QBLOCK, mask=col_ok, other=0.0)
        g = fp8_block_step(g, a, a_scales + k0 // QBLOCK, row_ok, bg, sg, A_FP8, DOT_F32)
        u = fp8_block_step(u, a, a_scales + k0 // QBLOCK, row_ok, bu, su, A_FP8, DOT_F32)
    h = clamped_swiglu(g, u, limit)
    h_rows = pair.to(tl.int64)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if A_FP8:
        q, scale = quantize_tile(h)  # columns past I are 0 and leave the amax alone
        tl.store(h_ptr + h_rows[:, None] * stride_h + cols[None, :], q, mask=out_ok)
        tl.store(h_s_ptr + h_rows * stride_hs + tl.program_id(1), scale, mask=row_ok)
    else:
        tl.store(h_ptr + h_rows[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["pairs", "experts"])  # per-step counts: one build for all
def _down_grouped(h_ptr, h_s_ptr, rows_ptr, block_expert_ptr, dw_ptr, ds_ptr, rw_ptr, y_ptr, D, pairs, experts,
                  stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                  I: tl.constexpr, A_FP8: tl.constexpr, DOT_F32: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    """Program (row block of one expert, column block): y[pair] = weight[pair] * down_e h[pair]."""
    block = tl.program_id(0)
    expert, pair, row_ok = sorted_block(rows_ptr, block_expert_ptr, block, pairs, BM)
    if expert >= experts:  # a padding block past the last expert's rows
        return
    h_rows = tl.where(row_ok, pair, 0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < D
    a_rows = h_ptr + h_rows[:, None] * stride_h
    a_scales = h_s_ptr + h_rows * stride_hs
    w_cols = expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    s_cols = expert * stride_se + (cols // QBLOCK) * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, QBLOCK):
        ks = k0 + tl.arange(0, QBLOCK)
        k_ok = ks < I
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(dw_ptr + w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.load(ds_ptr + s_cols + k0 // QBLOCK, mask=col_ok, other=0.0)
        acc = fp8_block_step(acc, a, a_scales + k0 // QBLOCK, row_ok, b, s, A_FP8, DOT_F32)
    acc *= tl.load(rw_ptr + h_rows, mask=row_ok, other=0.0)[:, None]
    tl.store(y_ptr + h_rows[:, None] * stride_y + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def _gemv_rows(programs: int, n: int, device: torch.device) -> int:
    """Rows per GEMV program: the largest slice (a divisor of 128) that still gives every SM two programs."""
    for rows in (64, 32, 16):
        if programs * triton.cdiv(n, rows) >= 2 * sm_count(device):
            return rows
    return 8


def _check(gate: Fp8BlockWeight, up: Fp8BlockWeight, down: Fp8BlockWeight) -> None:
    for w in (gate, up, down):
        assert w.block == FP8_BLOCK and w.data.stride(-1) == 1 and w.scale_inv.stride(-1) == 1
    assert gate.data.stride() == up.data.stride() and gate.scale_inv.stride() == up.scale_inv.stride()


def _decode(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, gate: Fp8BlockWeight, up: Fp8BlockWeight,
            down: Fp8BlockWeight, limit: float) -> torch.Tensor:
    t, d = x.shape
    k = ids.shape[1]
    i = gate.shape[1]
    h = torch.empty(t * k, i, dtype=torch.float32, device=x.device)
    bn = _gemv_rows(t * k, i, x.device)
    _gate_up_gemv[(t * k, triton.cdiv(i, bn))](
        x, ids, rw, gate.data, gate.scale_inv, up.data, up.scale_inv, h, i, limit,
        x.stride(0), gate.data.stride(0), gate.data.stride(1), gate.scale_inv.stride(0), gate.scale_inv.stride(1),
        D=d, TOPK=k, BN=bn, BK=_GEMV_TILE // bn, num_warps=4)
    out = torch.empty_like(x)
    bn = _gemv_rows(t, d, x.device)
    _down_gemv[(t, triton.cdiv(d, bn))](
        h, ids, rw, down.data, down.scale_inv, out, d,
        down.data.stride(0), down.data.stride(1), down.scale_inv.stride(0), down.scale_inv.stride(1), out.stride(0),
        I=i, TOPK=k, BN=bn, BK=_GEMV_TILE // bn, num_warps=4)
    return out


def _prefill(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, gate: Fp8BlockWeight, up: Fp8BlockWeight,
             down: Fp8BlockWeight, limit: float) -> torch.Tensor:
    t, d = x.shape
    k = ids.shape[1]
    e, i, _ = gate.shape
    p = t * k
    bm = _TILE_ROWS
    a_fp8 = x.dtype != torch.float32
    f32 = dot_f32(x)
    rows, block_expert = align_by_expert(ids, e, bm)
    if a_fp8:
        a, a_s = quantize_activations(x)
        h = torch.empty(p, i, dtype=torch.float8_e4m3fn, device=x.device)
        h_s = torch.empty(p, triton.cdiv(i, QBLOCK.value), dtype=torch.float32, device=x.device)
    else:  # the scale arguments are never read
        a, a_s = x, x
        h = torch.empty(p, i, dtype=x.dtype, device=x.device)
        h_s = h
    bn = QBLOCK.value if a_fp8 else 64  # fp8: one h scale block per program
    _gate_up_grouped[(block_expert.numel(), triton.cdiv(i, bn))](
        a, a_s, rows, block_expert, gate.data, gate.scale_inv, up.data, up.scale_inv, h, h_s, i, p, e, limit,
        a.stride(0), a_s.stride(0), gate.data.stride(0), gate.data.stride(1),
        gate.scale_inv.stride(0), gate.scale_inv.stride(1), h.stride(0), h_s.stride(0),
        D=d, TOPK=k, A_FP8=a_fp8, DOT_F32=f32, BM=bm, BN=bn, num_warps=8, num_stages=3)
    y = torch.empty(p, d, dtype=torch.float32, device=x.device)
    _down_grouped[(block_expert.numel(), triton.cdiv(d, bn))](
        h, h_s, rows, block_expert, down.data, down.scale_inv, rw, y, d, p, e,
        h.stride(0), h_s.stride(0), down.data.stride(0), down.data.stride(1),
        down.scale_inv.stride(0), down.scale_inv.stride(1), y.stride(0),
        I=i, A_FP8=a_fp8, DOT_F32=f32, BM=bm, BN=bn, num_warps=8, num_stages=3)
    return y.view(t, k, d).sum(1).to(x.dtype)


def fp8_block_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate: Fp8BlockWeight,
                  up: Fp8BlockWeight, down: Fp8BlockWeight, limit: float) -> torch.Tensor:
    """x [T, D]; expert_ids [T, k] int64; weights [T, k] fp32; stacks [E, I, D], [E, I, D], [E, D, I] -> [T, D].

    sum_k weights_k * down_e(clampedclamped_swiglu(gate_e x, up_e x, limit)) in x's dtype, as TorchExperts.
    """
    _check(gate, up, down)
    x, ids, rw = x.contiguous(), expert_ids.contiguous(), weights.float().contiguous()
    run = _decode if x.shape[0] <= DECODE_MAX_TOKENS else _prefill
    return run(x, ids, rw, gate, up, down, limit)
