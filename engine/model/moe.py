"""MoE block: fp32 sigmoid router with bias-for-selection-only, routed experts via an executor, shared expert
(handed to the executor, which runs it where it overlaps best: beside the host's share under offload)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kernels import kernel
from engine.experts import ExpertExecutor
from engine.model.mlp import DenseMlp


class Router:
    def __init__(self, cfg: ModelConfig, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.cfg, self.weight, self.bias = cfg, weight.float(), bias.float()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [T, k], weights [T, k] fp32)."""
        c = self.cfg
        return kernel("route", x.device.type)(x.float() @ self.weight.t(), self.bias, c.num_experts_per_tok,
                                              c.norm_topk_prob, c.routed_scaling_factor)


class MoE:
    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, layer: int, experts: ExpertExecutor) -> None:
        p = prefix + "mlp."
        self.layer, self.experts = layer, experts
        self.router = Router(cfg, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"])
        self.shared = DenseMlp(w, p + "shared_experts.", cfg.swiglu_limit)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        return self.experts(self.layer, x, ids, weights, shared_expert=lambda: self.shared(x))
