"""GLM-5.3-Flash text model: embedding (an image token's input is its image's tower output instead) -> 4 mHC
streams -> 45 decoder layers -> mean, norm, lm_head."""

from __future__ import annotations

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.experts import ExpertExecutor, default_executor
from engine.kernels.mhc import MhcPartials
from engine.model.batch import ForwardBatch
from engine.model.dsa import DsaMixer
from engine.model.kda import KdaMixer
from engine.model.layers import linear, rms_norm
from engine.model.mhc import HyperConnection
from engine.model.mlp import DenseMlp
from engine.model.moe import MoE


class DecoderLayer:
    """Two mHC sites: (mix and input norm, KDA or DSA, combine) then (mix and post norm, MLP or MoE, combine)."""

    def __init__(self, cfg: ModelConfig, w: dict, index: int, experts: ExpertExecutor) -> None:
        p = f"layers.{index}."
        self.attn_hc = HyperConnection.from_weights(cfg, w, p, "attn", "input_layernorm")
        self.ffn_hc = HyperConnection.from_weights(cfg, w, p, "ffn", "post_attention_layernorm")
        self.is_kda = cfg.layer_kinds[index] == "kda"
        kinds_before = cfg.layer_kinds[:index]
        self.mixer = (KdaMixer(cfg, w, p, kinds_before.count("kda")) if self.is_kda
                      else DsaMixer(cfg, w, p, kinds_before.count("dsa")))
        self.mlp = (MoE(cfg, w, p, index, experts) if cfg.mlp_kinds[index] == "moe"
                    else DenseMlp(w, p + "mlp.", cfg.swiglu_limit))

    def __call__(self, streams: torch.Tensor, batch: ForwardBatch, slots: RequestSlots, cache: PagedLatents,
                 partials: MhcPartials | None = None,
                 following: HyperConnection | None = None) -> tuple[torch.Tensor, MhcPartials | None]:
        """-> (the new streams, the `following` site's partials where the combine computed them)."""
        x, post, comb = self.attn_hc.collapse(streams, partials)
        y = self.mixer(x, batch, slots) if self.is_kda else self.mixer(x, batch, slots, cache)
        streams, partials = self.attn_hc.expand(streams, y, post, comb, self.ffn_hc)
        x, post, comb = self.ffn_hc.collapse(streams, partials)
        return self.ffn_hc.expand(streams, self.mlp(x), post, comb, following)


class Glm5NextModel:
    def __init__(self, cfg: ModelConfig, weights: dict, experts: ExpertExecutor | None = None) -> None:
        self.cfg = cfg
        experts = experts or default_executor(weights, cfg.moe_layers, cfg.swiglu_limit, weights["norm.weight"].device)
        self.embed = weights["embed_tokens.weight"]
        self.layers = [DecoderLayer(cfg, weights, i, experts) for i in range(cfg.num_layers)]
        self.norm, self.lm_head = weights["norm.weight"], weights["lm_head"]

    def use_experts(self, experts: ExpertExecutor) -> None:
        """Run the routed experts with `experts` from the next step on (early readiness drops its wrapper)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts = experts

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, slots: RequestSlots, cache: PagedLatents, logit_rows: torch.Tensor,
                layer_outputs: list[torch.Tensor] | None = None,
                hidden_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one step and returns fp32 logits [len(logit_rows), vocab]; fills `layer_outputs` when given, and
        `hidden_out` with every row's collapsed hidden before the final norm (the MTP layer's input)."""
        x = self.embed[batch.token_ids]
        if batch.embeds is not None:
            rows, values = batch.embeds
            x[rows] = values.to(x.dtype)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        partials = None
        for index, layer in enumerate(self.layers):
            following = self.layers[index + 1].attn_hc if index + 1 < len(self.layers) else None
            streams, partials = layer(streams, batch, slots, cache, partials, following)
            if layer_outputs is not None:
                layer_outputs.append(streams.clone())
        if hidden_out is not None:  # every row collapsed once, the logits' rows taken from it
            hidden_out.append(streams.mean(dim=1))
            collapsed = hidden_out[-1][logit_rows]
        else:
            collapsed = streams[logit_rows].mean(dim=1)
        hidden = rms_norm(collapsed, self.norm, self.cfg.rms_norm_eps)
        return linear(hidden, self.lm_head).float()
