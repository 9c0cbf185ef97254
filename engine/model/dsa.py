"""DSA mixer (11 layers): NoPE MLA in absorbed form over paged latents, with the kpool lightning indexer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache import PagedLatents, RequestSlots
from engine.config import ModelConfig
from engine.kernels import kernel
from engine.model.batch import DecodeMeta, ForwardBatch, SeqSpan
from engine.model.layers import FusedLinear, linear, rms_norm


@dataclass(frozen=True)
class SpanRows:
    """A mixed step's multi-token spans as cache rows, built on the host once per step and read by every DSA
    layer: where the new latents go, which keys complete which pools (sources: each span's open pool, B * kpool
    rows in span order, then the new keys) and which stay open, and per span the rows of all its keys and
    complete pools. Each layer then writes all spans' latents and pools in a few launches, where computing the
    rows on the device cost a dozen launches per span and layer."""

    latents: torch.Tensor  # [N] cache row of each new token, spans one after another
    pool_members: torch.Tensor  # [P, kpool] source rows of each pool the step completes
    pool_targets: torch.Tensor  # [P] its row in the pooled-key cache
    open_sources: torch.Tensor  # [M] source rows of the keys left in an open pool
    open_slots: torch.Tensor  # [M] their request slot
    open_places: torch.Tensor  # [M] and place in it (position % kpool)
    keys: list[torch.Tensor]  # per span: cache rows of positions 0 .. total
    pools: list[torch.Tensor]  # per span: rows of its complete pools
    positions: list[torch.Tensor]  # per span: positions of its new tokens

    @classmethod
    def of(cls, spans: list[SeqSpan], cache: PagedLatents, kpool: int, device: torch.device) -> "SpanRows":
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in cls.__dataclass_fields__}
        new_keys = len(spans) * kpool  # source row of the first new key
        for index, span in enumerate(spans):
            pages, cached = torch.tensor(span.pages).unsqueeze(0), span.cached
            everything = torch.arange(span.total)
            keys = cache.rows_at(pages, everything.unsqueeze(0))[0]
            completed = torch.arange(cached // kpool, span.total // kpool)
            still_open = torch.arange(max(cached, span.total // kpool * kpool), span.total)
            members = completed.unsqueeze(1) * kpool + torch.arange(kpool)
            parts["latents"].append(keys[cached:])
            parts["pool_members"].append(_key_sources(members.flatten(), cached, index * kpool, new_keys, kpool))
            parts["pool_targets"].append(cache.pool_rows_at(pages, completed.unsqueeze(0))[0])
            parts["open_sources"].append(_key_sources(still_open, cached, index * kpool, new_keys, kpool))
            parts["open_slots"].append(torch.full_like(still_open, span.slot))
            parts["open_places"].append(still_open % kpool)
            parts["keys"].append(keys)
            parts["pools"].append(cache.pool_rows_at(pages, torch.arange(span.total // kpool).unsqueeze(0))[0])
            parts["positions"].append(everything[cached:])
            new_keys += span.new
        return cls._packed(parts, kpool, device)

    @classmethod
    def _packed(cls, parts: dict[str, list[torch.Tensor]], kpool: int, device: torch.device) -> "SpanRows":
        """Every index tensor to the device in one copy (one host sync); fields are views of it, a field's spans
        side by side."""
        names = list(cls.__dataclass_fields__)
        packed = torch.cat([t for name in names for t in parts[name]]).to(device)
        whole = dict(zip(names, packed.split([sum(t.numel() for t in parts[name]) for name in names])))
        per_span = {name: list(whole[name].split([t.numel() for t in parts[name]]))
                    for name in ("keys", "pools", "positions")}
        return cls(**{**whole, **per_span, "pool_members": whole["pool_members"].view(-1, kpool)})


def _key_sources(positions: torch.Tensor, cached: int, held: int, new: int, kpool: int) -> torch.Tensor:
    """Source rows of a span's keys at `positions`: a key before `cached` is held in the span's open pool (its
    rows start at `held`), a later one is among the step's new keys (the span's start at `new`)."""
    return torch.where(positions < cached, held + positions % kpool, new + positions - cached)


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

    def add_tokens(self, keys_gates: torch.Tensor, rows: SpanRows, slots: torch.Tensor, open_pool: torch.Tensor,
                   cache: PagedLatents, layer: int) -> None:
        """Append the multi-token spans' keys (in span order; `slots` theirs): complete pools become pooled keys
        in the cache, the rest stays open."""
        d = self.cfg.index_head_dim
        sources = torch.cat([open_pool[slots].flatten(0, 1), keys_gates])
        if rows.pool_targets.numel():
            groups = sources[rows.pool_members]
            pooled = kernel("index_pool", keys_gates.device.type)(groups[..., :d], groups[..., d:], self.ape)
            cache.pool_keys[layer, rows.pool_targets] = pooled
        open_pool[rows.open_slots, rows.open_places] = sources[rows.open_sources]

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

    def select(self, q: torch.Tensor, weights: torch.Tensor, pools: torch.Tensor, positions: torch.Tensor,
               cache: PagedLatents, layer: int) -> torch.Tensor:
        """Pool ids [n, W] for one span's queries at `positions`, among its complete pools (cache rows `pools`)."""
        return kernel("index_select", q.device.type)(q, weights, cache.pool_keys[layer, pools],
                                                     (positions + 1) // self.cfg.index_kpool,
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
        if batch.single_token:  # decoding requests in a mixed step: one pass of the decode path for them all
            one = batch.single_rows
            out[one] = self._attend_decode(q_abs[one], latent[one], iq[one], iw[one], ikg[one], batch.single,
                                           open_pool, cache)
        if not batch.multi_token:
            return out
        prefill, slot_ids = batch.prefill_layout[:2]
        multi = [batch.spans[i] for i in batch.multi_token]
        rows = batch.layout(SpanRows, lambda: SpanRows.of(multi, cache, cfg.index_kpool, q_abs.device))
        cache.latents[layer, rows.latents] = latent[prefill]
        self.indexer.add_tokens(ikg[prefill], rows, slot_ids, open_pool, cache, layer)
        for span, keys, pools, positions in zip(multi, rows.keys, rows.pools, rows.positions):
            sl = span.rows
            pool_ids = self.indexer.select(iq[sl], iw[sl], pools, positions, cache, layer)
            out[sl] = kernel("sparse_mla", q_abs.device.type)(
                q_abs[sl], cache.latents[layer, keys], pool_ids, positions, cfg.index_kpool,
                cfg.qk_nope_head_dim ** -0.5, cfg.index_always_select_tail)
        return out
