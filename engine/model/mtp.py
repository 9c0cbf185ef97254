"""The multi-token-prediction (MTP) layer: a draft of the token after next, from the main model's hidden state at
a position and the token that follows it (the checkpoint's layer `num_layers`; spec 2.7).

    z = eh_proj([enorm(embed(next token)) ; hnorm(h)])    h: the main model's collapsed hidden, before its norm
    z += DSA(input_layernorm(z))                            its own latents and indexer, over the MTP's positions
    z += MoE(post_attention_layernorm(z))
    logits = lm_head(shared_head.norm(z))

A plain pre-norm residual block (no mHC). Its DSA reads the latents of every earlier position it ran at, so it
keeps a cache of its own beside the main model's: one DSA layer's latent pages and open indexer pools
(`MtpCaches`), indexed by the same request slots and page ids as the main caches, so a request's pages serve both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.experts import ExpertExecutor
from engine.model.batch import ForwardBatch
from engine.model.dsa import DsaMixer
from engine.model.layers import linear, rms_norm
from engine.model.moe import MoE


def mtp_attention_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` cut to one DSA layer: the shape of the MTP layer's own caches."""
    return dataclasses.replace(cfg, num_layers=1, layer_kinds=("dsa",), mlp_kinds=("moe",), num_mtp_layers=0)


@dataclass(frozen=True)
class MtpCaches:
    """The MTP layer's latent pages and open indexer pools, as many slots and pages as the main caches."""

    slots: RequestSlots
    cache: PagedLatents

    @classmethod
    def like(cls, cfg: ModelConfig, slots: RequestSlots, cache: PagedLatents) -> "MtpCaches":
        one = mtp_attention_config(cfg)
        dtype, device = cache.latents.dtype, cache.latents.device
        return cls(RequestSlots(one, slots.num_slots, device, dtype),
                   PagedLatents(one, cache.num_pages, cache.page_size, device, dtype))


class MtpLayer:
    def __init__(self, cfg: ModelConfig, w: dict, index: int, experts: ExpertExecutor) -> None:
        p = f"layers.{index}."
        self.eps = cfg.rms_norm_eps
        self.embed, self.lm_head = w["embed_tokens.weight"], w["lm_head"]
        self.enorm, self.hnorm, self.eh_proj = w[p + "enorm.weight"], w[p + "hnorm.weight"], w[p + "eh_proj"]
        self.input_norm, self.post_norm = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
        self.mixer = DsaMixer(cfg, w, p, cache_index=0)  # the MTP caches hold this one DSA layer
        self.mlp = MoE(cfg, w, p, index, experts)
        self.head_norm = w[p + "shared_head.norm.weight"]

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, batch: ForwardBatch, caches: MtpCaches,
                 logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, D]: the main model's collapsed hidden at each row of `batch`, whose `token_ids` are the
        tokens that follow those rows. Returns fp32 logits of `logit_rows` (every row when None) and the
        layer's output z [T, D] (the next draft step's hidden)."""
        embedded = rms_norm(self.embed[batch.token_ids], self.enorm, self.eps)
        z = linear(torch.cat([embedded, rms_norm(hidden.to(embedded.dtype), self.hnorm, self.eps)], dim=-1),
                   self.eh_proj)
        z = z + self.mixer(rms_norm(z, self.input_norm, self.eps), batch, caches.slots, caches.cache)
        z = z + self.mlp(rms_norm(z, self.post_norm, self.eps))
        rows = z if logit_rows is None else z[logit_rows]
        return linear(rms_norm(rows, self.head_norm, self.eps), self.lm_head).float(), z
