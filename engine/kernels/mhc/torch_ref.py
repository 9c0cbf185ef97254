"""Portable mHC: fp32 mixing weights with Sinkhorn, in the model's order (one column pass first)."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register
from engine.kernels.norm.torch_ref import rms_norm


@register("mhc_pre", "torch")
def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor,
            eps: float, hc_eps: float, sinkhorn_iters: int,
            partials: None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> (sublayer input, RMSNorm'd by `norm` [T, D], post [T, S] fp32, comb [T, S, S] fp32
    indexed [a, b]). This path reduces from the streams: its mhc_post hands no partials on."""
    t, s, _ = streams.shape
    flat = streams.reshape(t, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    mixed = flat @ fn.float().t()
    pre_w, post_w, comb_w = mixed.split([s, s, s * s], dim=-1)
    pre_b, post_b, comb_b = base.split([s, s, s * s])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(t, s, s) * scale[2] + comb_b.view(s, s), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return rms_norm(collapsed, norm, eps), post, comb


@register("mhc_post", "torch")
def mhc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             next_fn: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """H_new[:, b] = post[b] * out + sum_a comb[a, b] * H[:, a], in the activation dtype; no partials for the
    next site (`next_fn` is the fused path's)."""
    dtype = streams.dtype
    mixed = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return mixed, None
