"""Small building blocks shared by every block: dispatched linear, RMSNorm, clamped SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import kernel
from engine.weights import Weight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    return kernel("linear", x.device.type)(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in fp32, cast back before the (plain, not 1+w) weight multiply."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L): the clamped gate feeds both factors of silu."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
