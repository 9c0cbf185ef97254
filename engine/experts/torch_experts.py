"""Reference expert executor: loops over the experts the batch hit, dequantizing only those."""

from __future__ import annotations

import torch

from engine.checkpoint.layout import EXPERT_PROJS, stacked_expert_name
from engine.experts.base import OnePlaceExperts
from engine.kernels.swiglu.torch_ref import clamped_swiglu
from engine.model.layers import linear
from engine.weights import Weight


class TorchExperts(OnePlaceExperts):
    def __init__(self, stacks: dict[int, tuple[Weight, Weight, Weight]], swiglu_limit: float) -> None:
        self.stacks, self.limit = stacks, swiglu_limit

    @classmethod
    def from_weights(cls, w: dict, layers: list[int], swiglu_limit: float) -> "TorchExperts":
        return cls({i: tuple(w[stacked_expert_name(i, p)] for p in EXPERT_PROJS) for i in layers}, swiglu_limit)

    def routed(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.stacks[layer]
        out = torch.zeros_like(x)
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
        token_of = order // expert_ids.shape[1]
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picks = order[start:start + count]
            tokens = token_of[start:start + count]
            start += count
            xe = x[tokens]
            h = clamped_swiglu(self.project(xe, gate[expert]), self.project(xe, up[expert]), self.limit)
            y = self.project(h, down[expert]) * weights.flatten()[picks, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out

    def project(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """One expert projection; executors on other hardware replace only this."""
        return linear(x, weight)
