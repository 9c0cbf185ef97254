"""Portable linear: expand the packed weight to the activation dtype, then one matmul."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register
from engine.weights import Weight


@register("linear", "torch")
def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    return x @ weight.dequantize(x.dtype).t()
