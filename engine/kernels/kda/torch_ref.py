"""Portable KDA. State is fp32 [H, K, V] per request; q/k are L2-normalised inside (eps in the root).

The chunked form is the WY representation used by fla's `naive_chunk_kda`, with the triangular
inverse taken by `solve_triangular` instead of a row loop; it equals the token recurrence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import kernel, register
from engine.kernels.linear.torch_ref import linear
from engine.weights import Weight

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def short_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [B, n, C], state [B, C, k-1] (previous inputs), weight [C, k] fp32.

    Returns (y [B, n, C] in x's dtype, new state [B, C, k-1]).
    """
    k = weight.shape[-1]
    seq = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, k-1+n]
    return _conv_silu(seq, weight).transpose(1, 2), seq[:, :, seq.shape[-1] - (k - 1):].clone()


class ConvRows(NamedTuple):
    """Where `short_conv_varlen` puts B sequences in one buffer: each sequence's k-1 previous inputs (`held`),
    then its tokens (`tokens`). `windows` are the conv outputs of the tokens (the window ending at each), `last`
    the rows of each sequence's last k-1 inputs (its new state). All int64 on the step's device."""

    tokens: torch.Tensor  # [N]
    windows: torch.Tensor  # [N]
    held: torch.Tensor  # [B, k-1]
    last: torch.Tensor  # [B, k-1]

    @classmethod
    def of(cls, lengths: list[int], history: int, device: torch.device) -> "ConvRows":
        """Built on the host and moved in one copy: a step computes it once for all its KDA layers."""
        firsts = torch.tensor([0] + lengths[:-1]).cumsum(0) + torch.arange(len(lengths)) * history
        held = firsts.unsqueeze(1) + torch.arange(history)
        tokens = torch.cat([torch.arange(f + history, f + history + n) for f, n in zip(firsts.tolist(), lengths)])
        last = held + torch.tensor(lengths).unsqueeze(1)
        packed = torch.cat([tokens, tokens - history, held.flatten(), last.flatten()]).to(device)
        n, b = tokens.shape[0], len(lengths)
        return cls(packed[:n], packed[n:2 * n], packed[2 * n:2 * n + b * history].view(b, history),
                   packed[2 * n + b * history:].view(b, history))


@register("short_conv_varlen", "torch")
def short_conv_varlen(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      rows: ConvRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` of B sequences of any lengths at once (a prefill step's spans: one set of launches, not one
    per span). x [N, C] the sequences' tokens one after another, state [B, C, k-1]; `rows` places them in one
    buffer, each sequence after its previous inputs, and one conv runs over it (outputs whose window reaches
    into the sequence before are never read).

    Returns (y [N, C] in x's dtype, new state [B, C, k-1]).
    """
    seq = conv_buffer(x, state, rows)
    return _conv_silu(seq.t().unsqueeze(0), weight)[0].t()[rows.windows], seq[rows.last].transpose(1, 2)


def conv_buffer(x: torch.Tensor, state: torch.Tensor, rows: ConvRows) -> torch.Tensor:
    """The ragged conv's input rows [rows, C] in x's dtype: each sequence's held inputs, then its tokens."""
    seq = x.new_empty(rows.tokens.shape[0] + rows.held.numel(), x.shape[1])
    seq[rows.held.flatten()] = state.to(x.dtype).transpose(1, 2).flatten(0, 1)
    seq[rows.tokens] = x
    return seq


def _conv_silu(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """seq [B, C, L] -> SiLU of the depthwise conv of each window of k, [B, C, L-k+1] in seq's dtype (computed in
    the weight's fp32)."""
    out = F.conv1d(seq.to(weight.dtype), weight.unsqueeze(1), groups=seq.shape[1])
    return F.silu(out).to(seq.dtype)


@register("kda_chunk", "torch")
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q,k,v [n, H, d]; g [n, H, dk] log-decay; beta [n, H]; state [H, dk, dv] fp32."""
    n, h, dk = k.shape
    out_dtype = q.dtype
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # [H, n, ...]
    q, k = _l2norm(q) * dk ** -0.5, _l2norm(k)
    pad = (-n) % CHUNK
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    s = state.float().clone()
    out = torch.empty_like(v)
    eye = torch.eye(CHUNK, device=q.device)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    for c0 in range(0, n + pad, CHUNK):
        sl = slice(c0, c0 + CHUNK)
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl, None]
        gc = g[:, sl].cumsum(dim=1)
        decay = (gc.unsqueeze(2) - gc.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf")).exp()
        a = -torch.einsum("hid,hjd,hijd->hij", kc * bc, kc, decay).tril(-1)
        t = torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False)
        u = t @ (vc * bc)
        w = t @ (kc * bc * gc.exp())
        aqk = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        v_new = u - w @ s
        out[:, sl] = (qc * gc.exp()) @ s + aqk @ v_new
        last = gc[:, -1:]
        s = s * last.transpose(1, 2).exp() + (kc * (last - gc).exp()).transpose(1, 2) @ v_new
    return out[:, :n].transpose(0, 1).to(out_dtype), s


@register("kda_step", "torch")
def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests. q,k,v [B, H, d]; g [B, H, dk]; beta [B, H]; state [B, H, dk, dv]."""
    out_dtype = q.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q, k = _l2norm(q) * k.shape[-1] ** -0.5, _l2norm(k)
    s = state.float() * g.exp().unsqueeze(-1)
    err = v - torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + k.unsqueeze(-1) * (beta.unsqueeze(-1) * err).unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q).to(out_dtype), s


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output gate: per-head RMSNorm (fp32 statistics, plain weight) times sigmoid(gate), in o's dtype.

    o, gate [..., H, d]; weight [d]."""
    of = o.float()
    normed = weight.float() * (of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps))
    return (normed * torch.sigmoid(gate.float())).to(o.dtype)


@register("forget_gate", "torch")
def forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, decay_rate: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Lower-bound log-decay in fp32: lower_bound * sigmoid(exp(A_log)[h] * (f + dt_bias)). f [T, H*d] -> [T, H, d]."""
    h = decay_rate.shape[0]
    return lower_bound * torch.sigmoid(decay_rate.view(h, 1) * (f.float() + dt_bias).view(f.shape[0], h, -1))


@register("kda_decode", "torch")
def kda_decode(qkv: torch.Tensor, forget_low: torch.Tensor, f_b: Weight, beta_logits: torch.Tensor,
               gate_low: torch.Tensor, g_b: Weight, conv_state: torch.Tensor, conv_weight: torch.Tensor,
               rec_state: torch.Tensor, slots: torch.Tensor, decay_rate: torch.Tensor, dt_bias: torch.Tensor,
               o_norm: torch.Tensor, lower_bound: float, eps: float) -> torch.Tensor:
    """One token for each of B requests: the gates' up-projections, short conv, gates, delta-rule step and gated
    output norm.

    qkv [B, 3P] pre-conv q|k|v, forget_low and gate_low [B, R] (the gates' low-rank inputs, up-projected by f_b and
    g_b [P, R]), beta_logits [B, H], all in the activation dtype.
    conv_state [S, 3P, c-1] and rec_state [S, H, d, d] are updated in place at rows `slots` [B].
    Returns o [B, P] in the activation dtype, ready for o_proj.
    """
    b, h, d = qkv.shape[0], decay_rate.shape[0], o_norm.shape[0]
    f, gate_out = linear(forget_low, f_b), linear(gate_low, g_b)
    mixed, conv_state[slots] = short_conv(qkv.unsqueeze(1), conv_state[slots], conv_weight)
    q, k, v = mixed.view(b, 3, h, d).unbind(1)
    g = forget_gate(f, dt_bias, decay_rate, lower_bound)
    o, rec_state[slots] = kda_step(q, k, v, g, torch.sigmoid(beta_logits), rec_state[slots])
    return gated_rms_norm(o, gate_out.view(b, h, d), o_norm, eps).view(b, h * d)


@register("kda_prefill", "torch")
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                rec_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Several sequences in one flat ragged batch: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1].

    q,k,v [N, H, d] post-conv; g [N, H, d] fp32 log-decay; beta [N, H]. rec_state [S, H, d, d] rows
    `slots` [B] hold the initial states and are replaced in place by the final ones.
    """
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    for slot, start, end in zip(slots.tolist(), bounds[:-1], bounds[1:]):
        sl = slice(start, end)
        out[sl], rec_state[slot] = kda_chunk(q[sl], k[sl], v[sl], g[sl], beta[sl], rec_state[slot])
    return out


def chunked_delta_rule(qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
                       cu_seqlens: torch.Tensor, conv_rows: ConvRows, decay_rate: torch.Tensor,
                       dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """`kda_spans` before its gated norm: one ragged short conv, the gates and one chunked KDA (fla's on CUDA).
    Returns o [N, H, d] in the activation dtype."""
    h = decay_rate.shape[0]
    mixed, conv_state[slots] = kernel("short_conv_varlen", qkv.device.type)(qkv, conv_state[slots], conv_weight,
                                                                            conv_rows)
    q, k, v = mixed.view(-1, 3, h, mixed.shape[1] // (3 * h)).unbind(1)
    g = kernel("forget_gate", qkv.device.type)(f, dt_bias, decay_rate, lower_bound)
    return kernel("kda_prefill", qkv.device.type)(q, k, v, g, torch.sigmoid(beta_logits), rec_state, slots,
                                                  cu_seqlens)


@register("kda_spans", "torch")
def kda_spans(qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, gate_out: torch.Tensor,
              conv_state: torch.Tensor, conv_weight: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor,
              cu_seqlens: torch.Tensor, conv_rows: ConvRows, longest: int, decay_rate: torch.Tensor,
              dt_bias: torch.Tensor, o_norm: torch.Tensor, lower_bound: float, eps: float) -> torch.Tensor:
    """`kda_decode` for B multi-token spans in one flat ragged batch (span i is rows cu_seqlens[i]:cu_seqlens[i+1],
    `conv_rows` their places in the conv buffer, `longest` the longest span's tokens): one ragged short conv,
    the gates, one chunked KDA (fla's on CUDA) and the gated norm. Returns o [N, P] in the activation dtype."""
    out = chunked_delta_rule(qkv, f, beta_logits, conv_state, conv_weight, rec_state, slots, cu_seqlens, conv_rows,
                             decay_rate, dt_bias, lower_bound)
    return gated_rms_norm(out, gate_out.view(out.shape), o_norm, eps).flatten(1)
