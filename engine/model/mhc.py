"""One mHC site: mixes the S residual streams into the sublayer input, then folds the output back."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kernels import kernel


class HyperConnection:
    def __init__(self, cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> None:
        self.cfg, self.fn, self.base, self.scale = cfg, fn, base, scale

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, S, D] -> (sublayer input [T, D], post, comb)."""
        c = self.cfg
        return kernel("mhc_pre", streams.device.type)(
            streams, self.fn, self.base, self.scale, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    def expand(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return kernel("mhc_post", streams.device.type)(streams, out, post, comb)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, w: dict, prefix: str, site: str) -> "HyperConnection":
        return cls(cfg, w[f"{prefix}hc_{site}_fn"], w[f"{prefix}hc_{site}_base"], w[f"{prefix}hc_{site}_scale"])
