"""Fused KDA decode for CUDA: the gates' low-rank up-projections, short conv, gates, delta-rule step and gated
output norm in two launches.

Decode is bound by the fp32 state (64 heads x 128 x 128 x 4 B = 4 MiB per layer, read and written
once), so the step kernel spreads each head's state over dv-tiles: program (request, head, dv-tile)
holds a [d, BV] slice and recomputes the head's conv, L2 norms and gate (a few KiB, mostly L2 hits)
instead of waiting on another launch. The per-head output RMS needs every dv-tile, so a second small
kernel, one program per (request, head), applies the norm and gate; it also shifts the conv state,
which the step kernel's programs all read and so must not overwrite. With 16-bit dense up-projections each
program computes its head's forget (step) or output gate (norm) from the rank-R inputs: 2 x [D, R] of weights,
where two GEMV launches a layer wrote [B, H*D] and the kernels read them back. Inputs are read through their row
strides (views of the mixer's stacked projection, copied by nothing). Shapes decide every launch parameter and
slots stay on the device: the op is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.linear.triton_linear import linear
from engine.weights import DenseWeight, Weight

_TARGET_PROGRAMS = 256  # about two programs per SM on an H200 (132 SMs)


@triton.jit
def _conv_silu(x_row, state_row, weight, ch, CONV: tl.constexpr):
    """SiLU(depthwise causal conv) of channels `ch` over [state, x], rounded to x's dtype like the reference."""
    x = tl.load(x_row + ch)
    y = x.to(tl.float32) * tl.load(weight + ch * CONV + CONV - 1)
    for j in tl.static_range(CONV - 1):
        y += tl.load(state_row + ch * (CONV - 1) + j).to(tl.float32) * tl.load(weight + ch * CONV + j)
    return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)


@triton.jit
def _l2norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _delta_rule(s, q, k, v, g, beta):
    """One token of the gated delta rule on a [D, BV] state slice -> (new slice, the token's output [BV])."""
    s = s * tl.exp(g)[:, None]
    err = v - tl.sum(s * k[:, None], axis=0)
    s = s + k[:, None] * (beta * err)[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def _head_gate(x_ptr, w_ptr, row, i_h, stride_x, act: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
               LOW_RANK: tl.constexpr):
    """Head i_h's D gate inputs of `row` in fp32: w[i_h*D:(i_h+1)*D] @ x[row] rounded to the activations' dtype as
    the separate GEMV rounds (LOW_RANK: x [B, R], w [H*D, R]), or read as they are (x [B, H*D])."""
    o_d = tl.arange(0, D)
    if LOW_RANK:
        acc = tl.zeros([D], dtype=tl.float32)
        for r0 in tl.static_range(0, R, 32):
            rr = r0 + tl.arange(0, 32)
            w = tl.load(w_ptr + (i_h * D + o_d)[:, None] * R + rr[None, :], mask=rr[None, :] < R, other=0.0)
            x = tl.load(x_ptr + row * stride_x + rr, mask=rr < R, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        return acc.to(act).to(tl.float32)
    return tl.load(x_ptr + row * stride_x + i_h * D + o_d).to(tl.float32)


@triton.jit
def _step_kernel(qkv, f, f_b, beta_logits, conv_state, conv_weight, rec_state, slots, decay_rate, dt_bias, out,
                 lower_bound, scale, stride_qkv, stride_f, stride_beta, P: tl.constexpr, H: tl.constexpr,
                 D: tl.constexpr, BV: tl.constexpr, CONV: tl.constexpr, R: tl.constexpr, LOW_RANK: tl.constexpr):
    """Program (request b, head h, dv-tile): the head's conv/norms/gate, then its [D, BV] state slice."""
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    slot = tl.load(slots + i_b).to(tl.int64)
    o_k = tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)

    # The state slice is the long pole: issue its load before the small ones.
    p_s = rec_state + (slot * H + i_h) * D * D + o_k[:, None] * D + o_v[None, :]
    s = tl.load(p_s)

    x_row = qkv + i_b.to(tl.int64) * stride_qkv
    state_row = conv_state + slot * 3 * P * (CONV - 1)
    q = _l2norm(_conv_silu(x_row, state_row, conv_weight, i_h * D + o_k, CONV)) * scale
    k = _l2norm(_conv_silu(x_row, state_row, conv_weight, P + i_h * D + o_k, CONV))
    v = _conv_silu(x_row, state_row, conv_weight, 2 * P + i_h * D + o_v, CONV)

    forget = _head_gate(f, f_b, i_b.to(tl.int64), i_h, stride_f, out.dtype.element_ty, D, R, LOW_RANK)
    gate = forget + tl.load(dt_bias + i_h * D + o_k).to(tl.float32)
    g = lower_bound * tl.sigmoid(tl.load(decay_rate + i_h).to(tl.float32) * gate)
    logit = tl.load(beta_logits + i_b * stride_beta + i_h)
    beta = tl.sigmoid(logit.to(tl.float32)).to(logit.dtype).to(tl.float32)

    s, o = _delta_rule(s, q, k, v, g, beta)
    tl.store(p_s, s)
    tl.store(out + i_b * P + i_h * D + o_v, o.to(out.dtype.element_ty))


@triton.jit
def _shift_conv_state(x_row, state_row, ch, CONV: tl.constexpr, CP2: tl.constexpr):
    """state[ch] <- [state[ch, 1:], x[ch]]. Loads finish before any store: neighbours may be other threads."""
    taps = tl.arange(0, CP2)[None, :]
    p = state_row + ch[:, None] * (CONV - 1) + taps
    later = tl.load(p + 1, mask=taps < CONV - 2, other=0.0)
    x = tl.load(x_row + ch)
    new = tl.where(taps == CONV - 2, x[:, None], later)
    tl.debug_barrier()
    tl.store(p, new, mask=taps < CONV - 1)


@triton.jit
def _gated_norm(out, gate, o_norm, row, i_h, eps, P: tl.constexpr, D: tl.constexpr):
    """Row `row`, head `i_h` of o: RMSNorm(o) * o_norm * sigmoid(gate [D] fp32), in place."""
    o_d = tl.arange(0, D)
    p_o = out + row * P + i_h * D + o_d
    o = tl.load(p_o).to(tl.float32)
    normed = tl.load(o_norm + o_d).to(tl.float32) * (o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps))
    tl.store(p_o, (normed * tl.sigmoid(gate)).to(out.dtype.element_ty))


@triton.jit
def _norm_kernel(qkv, gate_in, g_b, conv_state, slots, o_norm, out, eps, stride_qkv, stride_gate,
                 P: tl.constexpr, H: tl.constexpr, D: tl.constexpr, CONV: tl.constexpr, CP2: tl.constexpr,
                 R: tl.constexpr, LOW_RANK: tl.constexpr):
    """Program (request b, head h): RMSNorm(o) * o_norm * sigmoid(gate) in place, then the conv state shift."""
    i_bh = tl.program_id(0)
    i_b = i_bh // H
    i_h = i_bh % H
    o_d = tl.arange(0, D)
    gate = _head_gate(gate_in, g_b, i_b.to(tl.int64), i_h, stride_gate, out.dtype.element_ty, D, R, LOW_RANK)
    _gated_norm(out, gate, o_norm, i_b, i_h, eps, P, D)

    slot = tl.load(slots + i_b).to(tl.int64)
    x_row = qkv + i_b.to(tl.int64) * stride_qkv
    state_row = conv_state + slot * 3 * P * (CONV - 1)
    for part in tl.static_range(3):
        _shift_conv_state(x_row, state_row, part * P + i_h * D + o_d, CONV, CP2)


def decode_launch_config(batch: int, heads: int, dim: int) -> tuple[int, int]:
    """(BV, num_warps): the widest dv-tile up to 64 that still gives ~2 programs per SM (wider tiles
    recompute the head's conv and norms fewer times). A 128-wide fp32 tile needs ~250 registers per
    thread on sm_90 and spills, so it is only used when asked for."""
    block_v = min(dim, 64)
    while block_v > 16 and batch * heads * (dim // block_v) < _TARGET_PROGRAMS:
        block_v //= 2
    return block_v, 4


def _low_rank(weight: Weight, x: torch.Tensor) -> torch.Tensor | None:
    """The up-projection's [N, R] data where the kernels compute it in registers (16-bit dense, the activations'
    dtype), else None."""
    if isinstance(weight, DenseWeight) and weight.data.dtype == x.dtype and weight.data.is_contiguous():
        return weight.data
    return None


def with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride (a view of a stacked projection already has it: no copy)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@register("kda_decode", "triton")
def kda_decode(qkv: torch.Tensor, forget_low: torch.Tensor, f_b: Weight, beta_logits: torch.Tensor,
               gate_low: torch.Tensor, g_b: Weight, conv_state: torch.Tensor, conv_weight: torch.Tensor,
               rec_state: torch.Tensor, slots: torch.Tensor, decay_rate: torch.Tensor, dt_bias: torch.Tensor,
               o_norm: torch.Tensor, lower_bound: float, eps: float, *, block_v: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """Same contract as the torch reference `kda_decode`; block_v/num_warps override the launch heuristic."""
    b, h, d = qkv.shape[0], decay_rate.shape[0], o_norm.shape[0]
    p, conv = h * d, conv_weight.shape[1]
    assert d & (d - 1) == 0 and d >= 16, "head dim must be a power of two >= 16"
    assert qkv.shape[1] == 3 * p and conv_state.shape[1:] == (3 * p, conv - 1) and rec_state.shape[1:] == (h, d, d)
    assert conv >= 2 and conv_state.is_contiguous() and rec_state.is_contiguous() and rec_state.dtype == torch.float32
    default_bv, default_warps = decode_launch_config(b, h, d)
    block_v, num_warps = block_v or default_bv, num_warps or default_warps
    assert d % block_v == 0
    f_w, g_w = _low_rank(f_b, forget_low), _low_rank(g_b, gate_low)
    low_rank = f_w is not None and g_w is not None and f_w.shape[1] == g_w.shape[1]
    # Formats the kernels do not read (FP8 blocks, NVFP4) take the linear op first, then the kernels read its output.
    f, gate = (forget_low, gate_low) if low_rank else (linear(forget_low, f_b), linear(gate_low, g_b))
    f_w, g_w = (f_w, g_w) if low_rank else (f, gate)  # never read without low_rank
    rank = f_w.shape[1] if low_rank else 1
    qkv, f, beta_logits, gate = (with_unit_stride(t) for t in (qkv, f, beta_logits, gate))
    out = torch.empty(b, p, dtype=qkv.dtype, device=qkv.device)
    _step_kernel[(b * h, d // block_v)](
        qkv, f, f_w, beta_logits, conv_state, conv_weight.contiguous(), rec_state, slots, decay_rate.contiguous(),
        dt_bias.contiguous(), out, lower_bound, d ** -0.5, qkv.stride(0), f.stride(0), beta_logits.stride(0),
        P=p, H=h, D=d, BV=block_v, CONV=conv, R=rank, LOW_RANK=low_rank, num_warps=num_warps)
    _norm_kernel[(b * h,)](qkv, gate, g_w, conv_state, slots, o_norm.contiguous(), out, eps, qkv.stride(0),
                           gate.stride(0), P=p, H=h, D=d, CONV=conv, CP2=triton.next_power_of_2(conv), R=rank,
                           LOW_RANK=low_rank, num_warps=4)
    return out
