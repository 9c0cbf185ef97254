"""Routed experts on CPU threads, over stacks in host RAM (the misses of hybrid offload).

A layer whose three stacks share one quantized format (NVFP4 or FP8 block, the release's) runs as one
compiled pass over all of its pairs: every expert weight is read once and never expanded, on an
explicitly sized thread count. Other layers (dense experts, mixed formats) take the reference loop with
each quantized projection through the compiled GEMV; machines where the kernels are not built keep the
torch projections.
"""

from __future__ import annotations

import torch

from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.cpu_gemv import ExpertStacks, available, gemv
from engine.weights import Fp8BlockWeight, Nvfp4Weight, Weight

QUANTIZED = (Nvfp4Weight, Fp8BlockWeight)


class CpuExperts(TorchExperts):
    def __init__(self, stacks: dict[int, tuple[Weight, Weight, Weight]], swiglu_limit: float,
                 threads: int | None = None) -> None:
        super().__init__(stacks, swiglu_limit)
        self.threads = threads or torch.get_num_threads()
        # C views of the stacks: their pointers stay valid while the stacks live (copies into a stack
        # write in place, so a swap does not move them).
        self.compiled = {layer: ExpertStacks(*s) for layer, s in stacks.items()
                         if len({type(w) for w in s}) == 1 and isinstance(s[0], QUANTIZED)}

    def routed(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        stacks = self.compiled.get(layer) if available() else None
        if stacks is None:
            return super().routed(layer, x, expert_ids, weights)
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        experts, counts = flat[order].unique_consecutive(return_counts=True)
        starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        tokens = order // expert_ids.shape[1]
        y = stacks.forward(x[tokens], experts, starts, weights.flatten()[order], self.limit, self.threads)
        return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, tokens, y).to(x.dtype)

    def project(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QUANTIZED) and available():
            return gemv(x, weight, self.threads).to(x.dtype)
        return super().project(x, weight)
