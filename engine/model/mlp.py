"""Dense feed-forward (layers before the first MoE layer, and the shared expert)."""

from __future__ import annotations

import torch

from engine.model.layers import FusedLinear, clamped_swiglu, linear


class DenseMlp:
    def __init__(self, w: dict, prefix: str, swiglu_limit: float) -> None:
        self.gate_up = FusedLinear(w, prefix + "gate_proj", prefix + "up_proj")
        self.down, self.limit = w[prefix + "down_proj"], swiglu_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return linear(clamped_swiglu(gate, up, self.limit), self.down)
