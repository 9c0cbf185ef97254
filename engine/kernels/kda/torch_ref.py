"""Portable KDA. State is fp32 [H, K, V] per request; q/k are L2-normalised inside (eps in the root).

The chunked form is the WY representation used by fla's `naive_chunk_kda`, with the triangular
inverse taken by `solve_triangular` instead of a row loop; it equals the token recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import register

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


@register("short_conv", "torch")
def short_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [B, n, C], state [B, C, k-1] (previous inputs), weight [C, k] fp32.

    Returns (y [B, n, C] in x's dtype, new state [B, C, k-1]).
    """
    n, c = x.shape[1:]
    k = weight.shape[-1]
    seq = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, k-1+n]
    out = F.conv1d(seq.to(weight.dtype), weight.unsqueeze(1), groups=c)  # [B, C, n]
    return F.silu(out).to(x.dtype).transpose(1, 2), seq[:, :, seq.shape[-1] - (k - 1):].clone()


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
