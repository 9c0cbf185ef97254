"""Routed experts on CPU threads, over stacks in host RAM (the misses of hybrid offload).

The reference executor's loop, with NVFP4 projections through the compiled GEMV (the weight is read
once and never expanded) on an explicitly sized thread count; other formats, and machines where the
kernel is not built, keep the torch projections.
"""

from __future__ import annotations

import torch

from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.cpu_gemv import available, nvfp4_gemv
from engine.weights import Nvfp4Weight, Weight


class CpuExperts(TorchExperts):
    def __init__(self, stacks: dict[int, tuple[Weight, Weight, Weight]], swiglu_limit: float,
                 threads: int | None = None) -> None:
        super().__init__(stacks, swiglu_limit)
        self.threads = threads or torch.get_num_threads()

    def project(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, Nvfp4Weight) and available():
            return nvfp4_gemv(x, weight, self.threads).to(x.dtype)
        return super().project(x, weight)
