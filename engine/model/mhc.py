"""One mHC site: mixes the S residual streams into the sublayer's normed input, then folds the output back."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kernels import kernel
from engine.kernels.mhc import MhcPartials


class HyperConnection:
    def __init__(self, cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 norm: torch.Tensor) -> None:
        self.cfg, self.fn, self.base, self.scale, self.norm = cfg, fn, base, scale, norm

    def collapse(self, streams: torch.Tensor,
                 partials: MhcPartials | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, S, D] -> (sublayer input, RMSNorm'd [T, D], post, comb). `partials`: what the expand that
        made `streams` already reduced for this site (a kernel's own; None: reduced here)."""
        c = self.cfg
        return kernel("mhc_pre", streams.device.type)(
            streams, self.fn, self.base, self.scale, self.norm, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
            partials)

    def expand(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               following: "HyperConnection | None" = None) -> tuple[torch.Tensor, MhcPartials | None]:
        """-> (new streams, the `following` site's partials where the kernel computes them on the way, else None)."""
        return kernel("mhc_post", streams.device.type)(streams, out, post, comb,
                                                       following.fn if following is not None else None)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, w: dict, prefix: str, site: str, norm: str) -> "HyperConnection":
        return cls(cfg, w[f"{prefix}hc_{site}_fn"], w[f"{prefix}hc_{site}_base"], w[f"{prefix}hc_{site}_scale"],
                   w[f"{prefix}{norm}.weight"])
