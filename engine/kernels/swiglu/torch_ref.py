"""Portable clamped SwiGLU, the model's order of casts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import register


@register("clamped_swiglu", "torch")
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L): the clamped gate feeds both factors of silu."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
