"""Routed experts on CPU threads, over stacks in host RAM (the misses of hybrid offload).

The reference executor's loop, with NVFP4 and FP8-block projections through the compiled GEMVs (the
weight is read once and never expanded) on an explicitly sized thread count; dense experts, and
machines where the kernels are not built, keep the torch projections.
"""

from __future__ import annotations

import torch

from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.cpu_gemv import available, fp8_block_gemv, nvfp4_gemv
from engine.weights import Fp8BlockWeight, Nvfp4Weight, Weight


class CpuExperts(TorchExperts):
    def __init__(self, stacks: dict[int, tuple[Weight, Weight, Weight]], swiglu_limit: float,
                 threads: int | None = None) -> None:
        super().__init__(stacks, swiglu_limit)
        self.threads = threads or torch.get_num_threads()

    def project(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        kernel = _KERNELS.get(type(weight)) if available() else None
        if kernel is None:
            return super().project(x, weight)
        return kernel(x, weight, self.threads).to(x.dtype)


_KERNELS = {Nvfp4Weight: nvfp4_gemv, Fp8BlockWeight: fp8_block_gemv}
