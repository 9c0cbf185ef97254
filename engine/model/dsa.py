"""DSA mixer (11 layers): NoPE MLA in absorbed form over paged latents, with the kpool lightning indexer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.kernels import kernel
from engine.model.batch import DecodeMeta, ForwardBatch, SeqSpan
from engine.model.layers import FusedLinear, linear, rms_norm


class Indexer:
    """Scores complete pools of `kpool` tokens per query; pooled keys are cached as pools complete."""

    def __init__(self, cfg: ModelConfig, w: dict, prefix: str) -> None:
        p = prefix + "indexer."
        self.cfg = cfg
        self.wq_b = w[p + "wq_b"]
        self.k_norm_w, self.k_norm_b = w[p + "k_norm.weight"], w[p + "k_norm.bias"]
        self.gate, self.ape = w[p + "index_kpool_compress_gate"], w[p + "index_kpool_compress_ape"]

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, k: torch.Tensor,
                head_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k = wk x, head_logits = weights_proj x (computed with the mixer's other projections of x)
        -> (queries [T, Hi, d], per-head weights [T, Hi] fp32, keys|gate logits [T, 2d])."""
        c = self.cfg
        q = linear(q_latent, self.wq_b).view(-1, c.index_n_heads, c.index_head_dim)
        k = F.layer_norm(k, (c.index_head_dim,), self.k_norm_w, self.k_norm_b, 1e-6)
        gate = x @ self.gate.t()
        weights = head_logits.float() * c.index_n_heads ** -0.5
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

    def add_and_select_decode(self, q: torch.Tensor, weights: torch.Tensor, keys_gates: torch.Tensor,
                              meta: DecodeMeta, open_pool: torch.Tensor, cache: PagedLatents,
                              layer: int) -> torch.Tensor:
        """Decode step of B requests with static shapes: append each token's key, select over every pool
        the page table can hold (pools a query cannot see yet are masked). -> pool ids [B, W]."""
        kp, d = self.cfg.index_kpool, self.cfg.index_head_dim
        pos = meta.positions
        open_pool[meta.slots, pos % kp] = keys_gates
        groups = open_pool[meta.slots]
        pooled = kernel("index_pool", q.device.type)(groups[..., :d], groups[..., d:], self.ape)
        # Written at every step: a pool becomes visible only once complete, and its last token rewrites it.
        cache.pool_keys[layer, cache.pool_rows_at(meta.page_table, (pos // kp).unsqueeze(1)).squeeze(1)] = pooled
        n_pools = meta.page_table.shape[1] * cache.page_size // kp
        every_pool = torch.arange(n_pools, device=q.device).expand(pos.shape[0], -1)
        pool_keys = cache.pool_keys[layer, cache.pool_rows_at(meta.page_table, every_pool)]  # [B, P, d]
        return kernel("index_select", q.device.type)(q, weights, pool_keys, (pos + 1) // kp,
                                                     self.cfg.index_select_pools)

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
        # Every projection of x in one matmul: query and latent down-projections, the indexer's key and head weights.
        self.inputs = FusedLinear(w, p + "q_a_proj", p + "kv_a_proj_with_mqa", p + "indexer.wk",
                                  p + "indexer.weights_proj")
        self.q_a_norm, self.q_b = w[p + "q_a_layernorm.weight"], w[p + "q_b_proj"]
        self.kv_a_norm = w[p + "kv_a_layernorm.weight"]
        h, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = w[p + "kv_b_proj"]
        kv_b = kv_b.dequantize(self.q_a_norm.dtype).view(h, dn + dv, cfg.kv_lora_rank)
        # Absorbed MLA: queries move into the latent space (W_UK) and outputs leave it (W_UV).
        self.w_uk, self.w_uv = kv_b[:, :dn].contiguous(), kv_b[:, dn:].contiguous()
        self.o = w[p + "o_proj"]
        self.indexer = Indexer(cfg, w, p)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, slots: RequestSlots, cache: PagedLatents) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_index
        q_low, kv_low, index_k, index_heads = self.inputs(x)
        q_latent = rms_norm(q_low, self.q_a_norm, cfg.rms_norm_eps)
        q = linear(q_latent, self.q_b).view(-1, cfg.num_attention_heads, cfg.qk_nope_head_dim)
        latent = rms_norm(kv_low, self.kv_a_norm, cfg.rms_norm_eps)
        iq, iw, ikg = self.indexer.project(x, q_latent, index_k, index_heads)
        q_abs = torch.einsum("thd,hdr->thr", q, self.w_uk)
        open_pool = slots.open_pool[layer]
        if batch.decode is not None:
            out = self._attend_decode(q_abs, latent, iq, iw, ikg, batch.decode, open_pool, cache)
        else:
            out = self._attend_spans(q_abs, latent, iq, iw, ikg, batch, open_pool, cache)
        o = torch.einsum("thr,hvr->thv", out, self.w_uv)
        return linear(o.reshape(x.shape[0], -1), self.o)

    def _attend_decode(self, q_abs: torch.Tensor, latent: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor,
                       ikg: torch.Tensor, meta: DecodeMeta, open_pool: torch.Tensor,
                       cache: PagedLatents) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_index
        cache.latents[layer, cache.rows_at(meta.page_table, meta.positions.unsqueeze(1)).squeeze(1)] = latent
        pool_ids = self.indexer.add_and_select_decode(iq, iw, ikg, meta, open_pool, cache, layer)
        return kernel("sparse_mla_decode", q_abs.device.type)(
            q_abs, cache.latents[layer], pool_ids, meta.positions, meta.page_table, cache.page_size,
            cfg.index_kpool, cfg.qk_nope_head_dim ** -0.5, cfg.index_always_select_tail)

    def _attend_spans(self, q_abs: torch.Tensor, latent: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor,
                      ikg: torch.Tensor, batch: ForwardBatch, open_pool: torch.Tensor,
                      cache: PagedLatents) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_index
        out = torch.empty_like(q_abs)
        for span in batch.spans:
            sl = span.rows
            cache.latents[layer, cache.token_rows(span.page_table, span.cached, span.total)] = latent[sl]
            self.indexer.add_tokens(ikg[sl], span, open_pool, cache, layer)
            pool_ids = self.indexer.select(iq[sl], iw[sl], span, cache, layer)
            keys = cache.latents[layer, cache.token_rows(span.page_table, 0, span.total)]
            positions = torch.arange(span.cached, span.total, device=q_abs.device)
            out[sl] = kernel("sparse_mla", q_abs.device.type)(
                q_abs[sl], keys, pool_ids, positions, cfg.index_kpool, cfg.qk_nope_head_dim ** -0.5,
                cfg.index_always_select_tail)
        return out
