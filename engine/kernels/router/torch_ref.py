"""Portable MoE routing: fp32 sigmoid scores, the correction bias for selection only."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register


@register("route", "torch")
def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, normalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (expert ids [T, k] int64, weights [T, k] fp32)."""
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling
