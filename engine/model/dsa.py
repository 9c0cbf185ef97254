"""DSA mixer (11 layers): NoPE MLA in absorbed form over paged latents, with the kpool lightning indexer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.kernels import kernel
from engine.model.batch import ForwardBatch, SeqSpan
from engine.model.layers import linear, rms_norm


class Indexer:
    """Scores complete pools of `kpool` tokens per query; pooled keys are cached as pools complete."""

    def __init__(self, cfg: ModelConfig, w: dict, prefix: str) -> None:
        p = prefix + "indexer."
        self.cfg = cfg
        self.wq_b, self.wk, self.weights_proj = w[p + "wq_b"], w[p + "wk"], w[p + "weights_proj"]
        self.k_norm_w, self.k_norm_b = w[p + "k_norm.weight"], w[p + "k_norm.bias"]
        self.gate, self.ape = w[p + "index_kpool_compress_gate"], w[p + "index_kpool_compress_ape"]

    def project(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (queries [T, Hi, d], per-head weights [T, Hi] fp32, keys|gate logits [T, 2d])."""
        c = self.cfg
        q = linear(q_latent, self.wq_b).view(-1, c.index_n_heads, c.index_head_dim)
        k = F.layer_norm(linear(x, self.wk), (c.index_head_dim,), self.k_norm_w, self.k_norm_b, 1e-6)
        gate = x @ self.gate.t()
        weights = linear(x, self.weights_proj).float() * c.index_n_heads ** -0.5
        return q, weights, torch.cat([k, gate], dim=-1)

    def add_tokens(self, keys_gates: torch.Tensor, span: SeqSpan, open_pool: torch.Tensor, cache: PagedLatents,
                   layer: int) -> None:
        """Append a span's keys: complete pools become pooled keys in the cache, the rest stays open."""
        kp, d = self.cfg.index_kpool, self.cfg.index_head_dim
        held = span.cached % kp
        pending = torch.cat([open_pool[span.slot, :held], keys_gates])
        full = pending.shape[0] // kp
        if full:
            groups = pending[: full * kp].view(full, kp, 2 * d)
            pooled = kernel("index_pool", keys_gates.device.type)(groups[..., :d], groups[..., d:], self.ape)
            first = span.cached // kp
            cache.pool_keys[layer, cache.pool_rows(span.page_table, first, first + full)] = pooled
        rest = pending[full * kp:]
        open_pool[span.slot, : rest.shape[0]] = rest

    def select(self, q: torch.Tensor, weights: torch.Tensor, span: SeqSpan, cache: PagedLatents,
               layer: int) -> torch.Tensor:
        kp = self.cfg.index_kpool
        pools = cache.pool_keys[layer, cache.pool_rows(span.page_table, 0, span.total // kp)]
        positions = torch.arange(span.cached, span.total, device=q.device)
        return kernel("index_select", q.device.type)(q, weights, pools, (positions + 1) // kp,
                                                     self.cfg.index_select_pools)


class DsaMixer:
    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, cache_index: int) -> None:
        p = prefix + "self_attn."
        self.cfg, self.cache_index = cfg, cache_index
        self.q_a, self.q_a_norm, self.q_b = w[p + "q_a_proj"], w[p + "q_a_layernorm.weight"], w[p + "q_b_proj"]
        self.kv_a, self.kv_a_norm = w[p + "kv_a_proj_with_mqa"], w[p + "kv_a_layernorm.weight"]
        h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = w[p + "kv_b_proj"]
        kv_b = kv_b.dequantize(self.q_a_norm.dtype).view(h, dn + dv, cfg.kv_lora_rank)
        # Absorbed MLA: queries move into the latent space (W_UK) and outputs leave it (W_UV).
        self.w_uk, self.w_uv = kv_b[:, :dn].contiguous(), kv_b[:, dn:].contiguous()
        self.o = w[p + "o_proj"]
        self.indexer = Indexer(cfg, w, p)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, slots: RequestSlots, cache: PagedLatents) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_index
        q_latent = rms_norm(linear(x, self.q_a), self.q_a_norm, cfg.rms_norm_eps)
        q = linear(q_latent, self.q_b).view(-1, cfg.num_attention_heads, cfg.qk_nope_head_dim)
        latent = rms_norm(linear(x, self.kv_a), self.kv_a_norm, cfg.rms_norm_eps)
        iq, iw, ikg = self.indexer.project(x, q_latent)
        q_abs = torch.einsum("thd,hdr->thr", q, self.w_uk)
        out = torch.empty_like(q_abs)
        open_pool = slots.open_pool[layer]
        for span in batch.spans:
            sl = span.rows
            cache.latents[layer, cache.token_rows(span.page_table, span.cached, span.total)] = latent[sl]
            self.indexer.add_tokens(ikg[sl], span, open_pool, cache, layer)
            pool_ids = self.indexer.select(iq[sl], iw[sl], span, cache, layer)
            keys = cache.latents[layer, cache.token_rows(span.page_table, 0, span.total)]
            positions = torch.arange(span.cached, span.total, device=x.device)
            out[sl] = kernel("sparse_mla", x.device.type)(
                q_abs[sl], keys, pool_ids, positions, cfg.index_kpool, cfg.qk_nope_head_dim ** -0.5,
                cfg.index_always_select_tail)
        o = torch.einsum("thr,hvr->thv", out, self.w_uv)
        return linear(o.reshape(x.shape[0], -1), self.o)
