"""What the executors that run every pair in one place share: the dense work beside the routed experts."""

from __future__ import annotations

from typing import Callable

import torch


class OnePlaceExperts:
    """An executor whose routed sum is computed in one place (`routed`): the dense work of the same layer
    that may run beside it (`shared_expert`) has nothing to overlap and is added after. An
    executor with a host side queues that work while the host computes instead (HybridExperts)."""

    def routed(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 shared_expert: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        out = self.routed(layer, x, expert_ids, weights)
        return out if shared_expert is None else out + shared_expert()
