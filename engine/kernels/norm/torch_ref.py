"""Portable RMSNorm, the model's order of casts."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register


@register("rms_norm", "torch")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in fp32, cast back before the (plain, not 1+w) weight multiply."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
