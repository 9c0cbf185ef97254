"""Dense feed-forward (layers before the first MoE layer, and the shared expert)."""

from __future__ import annotations

import torch

from engine.model.layers import clamped_swiglu, linear
from engine.weights import Weight


class DenseMlp:
    def __init__(self, gate: Weight, up: Weight, down: Weight, swiglu_limit: float) -> None:
        self.gate, self.up, self.down, self.limit = gate, up, down, swiglu_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(clamped_swiglu(linear(x, self.gate), linear(x, self.up), self.limit), self.down)

    @classmethod
    def from_weights(cls, w: dict, prefix: str, swiglu_limit: float) -> "DenseMlp":
        return cls(w[prefix + "gate_proj"], w[prefix + "up_proj"], w[prefix + "down_proj"], swiglu_limit)
