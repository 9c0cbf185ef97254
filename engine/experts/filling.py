"""An expert executor for early readiness: the experts a layer's batch routes to are brought in first.

While the background fill runs, some experts are not in their places yet. Before delegating, this
wrapper finds the batch's experts that have not arrived and loads them now (the same units the fill
reads, so nothing is read twice); the inner executor (all-resident or hybrid) then runs as usual.
Once the fill is complete the engine drops the wrapper.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.checkpoint.availability import ExpertAvailability
from engine.experts import ExpertExecutor


class FillingExperts:
    def __init__(self, inner: ExpertExecutor, availability: ExpertAvailability) -> None:
        self.inner, self.availability = inner, availability

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 shared_expert: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        if not self.availability.complete:
            used = expert_ids.unique().cpu()
            missing = used[~self.availability.loaded[layer][used]]
            if missing.numel():
                self.availability.ensure(layer, missing.tolist())
        return self.inner(layer, x, expert_ids, weights, shared_expert)
