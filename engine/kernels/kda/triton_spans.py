"""Fused KDA for short multi-token spans on CUDA: the decode step's recurrence, run token by token in one launch.

A cached agent turn or a small prefill chunk brings a few dozen tokens per request. The chunked path (a
ragged short conv, the gates, fla's chunk_kda in about a dozen launches with their autotuner lookups, the
gated norm) costs ~1.5 ms of host time per layer whatever the length, and such steps are host-bound. Here
program (span, head, dv-tile) keeps its [d, BV] slice of the fp32 state in registers and walks the span's
tokens: the short conv reads the span's earlier rows (or the conv state before the span), then the gates
and the delta-rule step as in `triton_decode`; a second launch writes each span's new conv state. Its work
grows with the longest span, so spans longer than SHORT_SPAN_TOKENS take the chunked path. Either way one
launch applies the gated norm per (token, head). The exact recurrence is the reference's math in fp32 (the
chunked form is the same recurrence regrouped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.kda.torch_ref import ConvRows, chunked_delta_rule
from engine.kernels.kda.triton_decode import _delta_rule, _gated_norm, _l2norm, with_unit_stride
from engine.kernels.token_variants import token_variants

# The longest span (tokens) the recurrence takes: its programs walk the span in series, ~1-3 us a token
# (est.), so up to here it costs less device time than the chunked path's host time.
SHORT_SPAN_TOKENS = 128
# One dv-tile width whatever the span count, so one specialization serves every step and a start precompiles
# it (ops.bench_kda's short spans on an H200, 64 heads of 128: 1 x 128 tokens in 296 us a layer at this width).
SPAN_BLOCK_V = 32
_SHAPES_RUN: set[tuple[int, int]] = set()  # (heads, head dim) of the layers run so far


@token_variants
def _builds(tokens: int) -> tuple:
    """A prefill of one span of `tokens` tokens takes the recurrence, or past SHORT_SPAN_TOKENS the chunked
    path: different kernels (the warm-up prefills one of each)."""
    return tuple((shape, tokens <= SHORT_SPAN_TOKENS) for shape in sorted(_SHAPES_RUN))


@triton.jit
def _conv_silu_at(qkv, start, t, state_row, weight, ch, CONV: tl.constexpr, row_stride):
    """SiLU(depthwise causal conv) of channels `ch` at token t of a span whose rows start at `start`: inputs
    before the span come from its conv state. Rounded to the activation dtype like the reference."""
    y = tl.zeros(ch.shape, tl.float32)
    for j in tl.static_range(CONV):
        back = t - (CONV - 1) + j  # the input's index in the span (< 0: held in the conv state)
        inside = (ch * 0 + back) >= 0
        x = tl.where(inside, tl.load(qkv + (start + back) * row_stride + ch, mask=inside, other=0.0),
                     tl.load(state_row + ch * (CONV - 1) + (CONV - 1 + back), mask=~inside, other=0.0))
        y += x.to(tl.float32) * tl.load(weight + ch * CONV + j)
    return (y * tl.sigmoid(y)).to(qkv.dtype.element_ty).to(tl.float32)


@triton.jit
def _spans_step_kernel(qkv, f, beta_logits, conv_state, conv_weight, rec_state, slots, cu_seqlens, decay_rate,
                       dt_bias, out, lower_bound, scale, stride_qkv, stride_beta, P: tl.constexpr, H: tl.constexpr,
                       D: tl.constexpr, BV: tl.constexpr, CONV: tl.constexpr):
    """Program (span s, head h, dv-tile): the head's conv/norms/gate per token, its [D, BV] state slice kept
    in registers across the span's tokens."""
    i_sh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_s = i_sh // H
    i_h = i_sh % H
    slot = tl.load(slots + i_s).to(tl.int64)
    start = tl.load(cu_seqlens + i_s).to(tl.int64)
    length = tl.load(cu_seqlens + i_s + 1).to(tl.int64) - start
    o_k = tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = rec_state + (slot * H + i_h) * D * D + o_k[:, None] * D + o_v[None, :]
    s = tl.load(p_s)
    state_row = conv_state + slot * 3 * P * (CONV - 1)
    bias = tl.load(dt_bias + i_h * D + o_k).to(tl.float32)
    rate = tl.load(decay_rate + i_h).to(tl.float32)
    t = length * 0
    while t < length:  # not `range(length)`: Triton's interpreter (the CPU tests) cannot take a loaded bound
        row = start + t
        q = _l2norm(_conv_silu_at(qkv, start, t, state_row, conv_weight, i_h * D + o_k, CONV, stride_qkv)) * scale
        k = _l2norm(_conv_silu_at(qkv, start, t, state_row, conv_weight, P + i_h * D + o_k, CONV, stride_qkv))
        v = _conv_silu_at(qkv, start, t, state_row, conv_weight, 2 * P + i_h * D + o_v, CONV, stride_qkv)
        g = lower_bound * tl.sigmoid(rate * (tl.load(f + row * P + i_h * D + o_k).to(tl.float32) + bias))
        logit = tl.load(beta_logits + row * stride_beta + i_h)
        beta = tl.sigmoid(logit.to(tl.float32)).to(logit.dtype).to(tl.float32)
        s, o = _delta_rule(s, q, k, v, g, beta)
        tl.store(out + row * P + i_h * D + o_v, o.to(out.dtype.element_ty))
        t += 1
    tl.store(p_s, s)


@triton.jit
def _rows_norm_kernel(gate_out, o_norm, out, eps, P: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """Program (token row, head h): the gated output norm in place."""
    i_rh = tl.program_id(0)
    row, i_h = (i_rh // H).to(tl.int64), i_rh % H
    gate = tl.load(gate_out + row * P + i_h * D + tl.arange(0, D)).to(tl.float32)
    _gated_norm(out, gate, o_norm, row, i_h, eps, P, D)


@triton.jit
def _spans_conv_state_kernel(qkv, conv_state, slots, cu_seqlens, stride_qkv, CHANNELS: tl.constexpr,
                             CONV: tl.constexpr, CP2: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (span s, channel block): the span's new conv state, its last CONV-1 inputs (from the conv state
    before it when the span is shorter). Loads finish before any store: neighbours may be other threads."""
    i_s = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    taps = tl.arange(0, CP2)[None, :]
    slot = tl.load(slots + i_s).to(tl.int64)
    start = tl.load(cu_seqlens + i_s).to(tl.int64)
    length = tl.load(cu_seqlens + i_s + 1).to(tl.int64) - start
    back = length - (CONV - 1) + taps  # the input's index in the span (< 0: held in the conv state)
    used = (ch < CHANNELS) & (taps < CONV - 1)
    inside = used & (back >= 0)
    state_row = conv_state + slot * CHANNELS * (CONV - 1) + ch * (CONV - 1)
    new = tl.where(inside, tl.load(qkv + (start + back) * stride_qkv + ch, mask=inside, other=0.0),
                   tl.load(state_row + (CONV - 1 + back), mask=used & (back < 0), other=0.0))
    tl.debug_barrier()
    tl.store(state_row + taps, new, mask=used)


@register("kda_spans", "triton")
def kda_spans(qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, gate_out: torch.Tensor,
              conv_state: torch.Tensor, conv_weight: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor, conv_rows: ConvRows, longest: int, decay_rate: torch.Tensor,
              dt_bias: torch.Tensor, o_norm: torch.Tensor, lower_bound: float, eps: float,
              *, block_v: int | None = None) -> torch.Tensor:
    """Same contract as the torch reference `kda_spans`; spans longer than SHORT_SPAN_TOKENS take its chunked
    form (fla's chunk_kda on CUDA) and this module's gated norm."""
    _SHAPES_RUN.add((decay_rate.shape[0], o_norm.shape[0]))
    n, h, d = qkv.shape[0], decay_rate.shape[0], o_norm.shape[0]
    if longest > SHORT_SPAN_TOKENS:
        out = chunked_delta_rule(qkv, f, beta_logits, conv_state, conv_weight, rec_state, slots, cu_seqlens,
                                 conv_rows, decay_rate, dt_bias, lower_bound).reshape(n, h * d)
    else:
        out = _recurrence(qkv, f, beta_logits, conv_state, conv_weight, rec_state, slots, cu_seqlens, decay_rate,
                          dt_bias, lower_bound, d, block_v)
    # the gated norm in one launch either way (the torch form takes ~8 passes over fp32 copies)
    _rows_norm_kernel[(n * h,)](gate_out.contiguous(), o_norm.contiguous(), out, eps, P=h * d, H=h, D=d,
                                num_warps=4)
    return out


def _recurrence(qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, conv_state: torch.Tensor,
                conv_weight: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                decay_rate: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, d: int,
                block_v: int | None) -> torch.Tensor:
    """Short spans token by token: o [N, H*d] before the gated norm; the spans' conv states updated in place."""
    n, spans = qkv.shape[0], slots.shape[0]
    h = decay_rate.shape[0]
    p, conv = h * d, conv_weight.shape[1]
    assert d & (d - 1) == 0 and d >= 16, "head dim must be a power of two >= 16"
    assert conv_state.is_contiguous() and rec_state.is_contiguous() and rec_state.dtype == torch.float32
    assert conv_state.dtype == qkv.dtype, "the conv state holds inputs in the activation dtype"
    block_v = block_v or min(d, SPAN_BLOCK_V)
    # q|k|v and beta are views of the mixer's stacked projection: read through their row strides, not copied
    qkv, beta_logits = with_unit_stride(qkv), with_unit_stride(beta_logits)
    out = torch.empty(n, p, dtype=qkv.dtype, device=qkv.device)
    _spans_step_kernel[(spans * h, d // block_v)](
        qkv, f.contiguous(), beta_logits, conv_state, conv_weight.contiguous(), rec_state, slots, cu_seqlens,
        decay_rate.contiguous(), dt_bias.contiguous(), out, lower_bound, d ** -0.5, qkv.stride(0),
        beta_logits.stride(0), P=p, H=h, D=d, BV=block_v, CONV=conv, num_warps=4)
    block_c = 256
    _spans_conv_state_kernel[(spans, triton.cdiv(3 * p, block_c))](
        qkv, conv_state, slots, cu_seqlens, qkv.stride(0), CHANNELS=3 * p, CONV=conv,
        CP2=triton.next_power_of_2(conv - 1), BLOCK_C=block_c, num_warps=4)
    return out
