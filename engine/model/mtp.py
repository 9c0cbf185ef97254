"""The multi-token-prediction (MTP) layer: a draft of the token after next, from the main model's hidden state at
a position and the token that follows it (the checkpoint's layer `num_layers`; spec 2.7).

    z = eh_proj([enorm(embed(next token)) ; hnorm(h)])    h: the main model's collapsed hidden, before its norm
    z += DSA(input_layernorm(z))                            its own latents and indexer, over the MTP's positions
    z += MoE(post_attention_layernorm(z))
    logits = lm_head(shared_head.norm(z))

A plain pre-norm residual block (no mHC). Its DSA reads the latents of every earlier position it ran at: the
caches hold it as one more DSA layer after the main model's (`with_mtp_cache`), so a request's slot and pages
serve both, and whatever saves or moves a request's state (verify steps, the prefix cache's snapshots, copied
pages and host tier) carries the MTP layer's with it.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.experts import ExpertExecutor
from engine.model.batch import ForwardBatch
from engine.model.dsa import DsaMixer
from engine.model.layers import linear, rms_norm
from engine.model.moe import MoE


def with_mtp_cache(cfg: ModelConfig) -> ModelConfig:
    """`cfg` as the caches see it with the MTP layer on: its DSA layer after the decoder layers, the caches' last
    DSA index (`mtp_cache_index`)."""
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + 1, layer_kinds=cfg.layer_kinds + ("dsa",),
                               mlp_kinds=cfg.mlp_kinds + ("moe",), num_mtp_layers=0)


def mtp_cache_index(cfg: ModelConfig) -> int:
    """The caches' DSA index of the MTP layer (after the main model's DSA layers)."""
    return len(cfg.dsa_layers)


class MtpLayer:
    def __init__(self, cfg: ModelConfig, w: dict, index: int, experts: ExpertExecutor) -> None:
        p = f"layers.{index}."
        self.eps = cfg.rms_norm_eps
        self.embed, self.lm_head = w["embed_tokens.weight"], w["lm_head"]
        self.enorm, self.hnorm, self.eh_proj = w[p + "enorm.weight"], w[p + "hnorm.weight"], w[p + "eh_proj"]
        self.input_norm, self.post_norm = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
        self.mixer = DsaMixer(cfg, w, p, cache_index=mtp_cache_index(cfg))
        self.mlp = MoE(cfg, w, p, index, experts)
        self.head_norm = w[p + "shared_head.norm.weight"]

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, batch: ForwardBatch, slots: RequestSlots,
                 cache: PagedLatents) -> torch.Tensor:
        """hidden [T, D]: the main model's collapsed hidden at each row of `batch`, whose `token_ids` are the
        tokens that follow those rows; `slots` and `cache` are built `with_mtp_cache`. Returns the layer's output
        z [T, D]: `logits` of it draft, and it is the next draft step's hidden."""
        embedded = rms_norm(self.embed[batch.token_ids], self.enorm, self.eps)
        z = linear(torch.cat([embedded, rms_norm(hidden.to(embedded.dtype), self.hnorm, self.eps)], dim=-1),
                   self.eh_proj)
        z = z + self.mixer(rms_norm(z, self.input_norm, self.eps), batch, slots, cache)
        return z + self.mlp(rms_norm(z, self.post_norm, self.eps))

    @torch.inference_mode()
    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """fp32 logits of rows of the layer's output (the shared head)."""
        return linear(rms_norm(z, self.head_norm, self.eps), self.lm_head).float()
