"""Routed-expert execution behind one interface, so placement (GPU, host RAM, PCIe fetch) never touches the model.

An executor gets the tokens of one MoE layer with their top-k expert ids and routing weights and
returns the weighted sum of the selected experts' outputs. The torch executor is the reference.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.experts.torch_experts import TorchExperts
from engine.kernels.dispatch import fast_kernels_enabled
from engine.experts.triton_experts import TritonExperts


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 shared_expert: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, D]; expert_ids [T, k]; weights [T, k] fp32 -> [T, D] in x's dtype, plus `shared_expert()` ([T, D]:
        the layer's dense work, the shared expert) when given, run where it overlaps the routed experts best."""
        ...


def executor_class(device: torch.device) -> type[TorchExperts] | type[TritonExperts]:
    """Triton kernels for CUDA weights (unless GLMFLASH_KERNELS=torch), the torch reference elsewhere."""
    return TritonExperts if device.type == "cuda" and fast_kernels_enabled() else TorchExperts


def default_executor(weights: dict, layers: list[int], swiglu_limit: float, device: torch.device) -> ExpertExecutor:
    return executor_class(device).from_weights(weights, layers, swiglu_limit)


__all__ = ["ExpertExecutor", "TorchExperts", "TritonExperts", "default_executor", "executor_class"]
