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
    rows in span order, then the new keys) and which stay open, and the spans' page tables with each new
    token's span and position. Each layer then writes, selects and attends for all spans in a few launches,
    where a launch chain per span and layer left the step waiting on the host."""

    latents: torch.Tensor  # [N] cache row of each new token, spans one after another
    pool_members: torch.Tensor  # [P, kpool] source rows of each pool the step completes
    pool_targets: torch.Tensor  # [P] its row in the pooled-key cache
    open_sources: torch.Tensor  # [M] source rows of the keys left in an open pool
    open_slots: torch.Tensor  # [M] their request slot
    open_places: torch.Tensor  # [M] and place in it (position % kpool)
    seqs: torch.Tensor  # [N] each new token's span (its row of page_table)
    positions: torch.Tensor  # [N] and position
    page_table: torch.Tensor  # [B, pages] each span's pages, padded with its last page
    n_pools: int  # complete pools of the longest span: the columns the indexer scores

    @classmethod
    def of(cls, spans: list[SeqSpan], cache: PagedLatents, kpool: int, device: torch.device) -> "SpanRows":
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in cls._index_fields()}
        new_keys = len(spans) * kpool  # source row of the first new key
        width = max(len(span.pages) for span in spans)
        for index, span in enumerate(spans):
            pages, cached = torch.tensor(span.pages).unsqueeze(0), span.num_computed
            new = torch.arange(cached, span.total)
            completed = torch.arange(cached // kpool, span.total // kpool)
            still_open = torch.arange(max(cached, span.total // kpool * kpool), span.total)
            members = completed.unsqueeze(1) * kpool + torch.arange(kpool)
            parts["latents"].append(cache.rows_at(pages, new.unsqueeze(0))[0])
            parts["pool_members"].append(_key_sources(members.flatten(), cached, index * kpool, new_keys, kpool))
            parts["pool_targets"].append(cache.pool_rows_at(pages, completed.unsqueeze(0))[0])
            parts["open_sources"].append(_key_sources(still_open, cached, index * kpool, new_keys, kpool))
            parts["open_slots"].append(torch.full_like(still_open, span.slot))
            parts["open_places"].append(still_open % kpool)
            parts["seqs"].append(torch.full_like(new, index))
            parts["positions"].append(new)
            parts["page_table"].append(torch.tensor(span.pages + span.pages[-1:] * (width - len(span.pages))))
            new_keys += span.new
        return cls._packed(parts, kpool, width, max(span.total for span in spans) // kpool, device)

    @classmethod
    def _index_fields(cls) -> list[str]:
        return [name for name in cls.__dataclass_fields__ if name != "n_pools"]

    @classmethod
    def _packed(cls, parts: dict[str, list[torch.Tensor]], kpool: int, width: int, n_pools: int,
                device: torch.device) -> "SpanRows":
        """Every index tensor to the device in one copy (one host sync); fields are views of it."""
        names = cls._index_fields()
        packed = torch.cat([t for name in names for t in parts[name]]).to(device)
        whole = dict(zip(names, packed.split([sum(t.numel() for t in parts[name]) for name in names])))
        return cls(**{**whole, "pool_members": whole["pool_members"].view(-1, kpool),
                      "page_table": whole["page_table"].view(-1, width)}, n_pools=n_pools)


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
            cache.write_pool_keys(layer, rows.pool_targets, pooled)
        open_pool[rows.open_slots, rows.open_places] = sources[rows.open_sources]

    def add_decode(self, keys_gates: torch.Tensor, meta: DecodeMeta, open_pool: torch.Tensor, cache: PagedLatents,
                   layer: int) -> None:
        """Decode step of B requests with static shapes: append each token's key and pool its open pool (with
        several tokens a request, token by token: a later one may start the next pool)."""
        if meta.per_request > 1:
            for t in range(meta.per_request):
                self.add_decode(keys_gates[t::meta.per_request], meta.token(t), open_pool, cache, layer)
            return
        kp, d = self.cfg.index_kpool, self.cfg.index_head_dim
        pos = meta.positions
        open_pool[meta.slots, pos % kp] = keys_gates
        groups = open_pool[meta.slots]
        pooled = kernel("index_pool", keys_gates.device.type)(groups[..., :d], groups[..., d:], self.ape)
        # Written at every step: a pool becomes visible only once complete, and its last token rewrites it.
        cache.write_pool_keys(layer, cache.pool_rows_at(meta.page_table, (pos // kp).unsqueeze(1)).squeeze(1), pooled)

    def select(self, q: torch.Tensor, weights: torch.Tensor, page_table: torch.Tensor, seqs: torch.Tensor | None,
               positions: torch.Tensor, n_pools: int, cache: PagedLatents, layer: int) -> torch.Tensor:
        """Pool ids [T, W] for queries at `positions` of the sequences `seqs` (rows of page_table; None: one row
        per query), among the first `n_pools` pools of their rows that are complete before them."""
        keys, scales = cache.layer_pool_keys(layer)
        return kernel("index_select", q.device.type)(q, weights, keys, page_table, seqs, positions, n_pools,
                                                     cache.per_page_pools, self.cfg.index_kpool,
                                                     self.cfg.index_select_pools, key_scales=scales)


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
        layer = self.cache_index
        cache.write_latents(layer, cache.rows_at(meta.page_table, meta.positions.unsqueeze(1)).squeeze(1), latent)
        self.indexer.add_decode(ikg, meta, open_pool, cache, layer)
        every_pool = meta.page_table.shape[1] * cache.per_page_pools
        pool_ids = self.indexer.select(iq, iw, meta.page_table, None, meta.positions, every_pool, cache, layer)
        return self._attend(q_abs, pool_ids, meta.positions, meta.page_table, None, cache)

    def _attend_spans(self, q_abs: torch.Tensor, latent: torch.Tensor, iq: torch.Tensor, iw: torch.Tensor,
                      ikg: torch.Tensor, batch: ForwardBatch, open_pool: torch.Tensor,
                      cache: PagedLatents) -> torch.Tensor:
        cfg, layer = self.cfg, self.cache_index
        out = torch.empty_like(q_abs)
        if batch.multi_token_spans:  # first: a prompt's last token may be a one-token row of this step
            prefill, slot_ids = batch.prefill_layout[:2]
            multi = [batch.spans[i] for i in batch.multi_token_spans]
            rows = batch.layout(SpanRows, lambda: SpanRows.of(multi, cache, cfg.index_kpool, q_abs.device))
            cache.write_latents(layer, rows.latents, latent[prefill])
            self.indexer.add_tokens(ikg[prefill], rows, slot_ids, open_pool, cache, layer)
            pool_ids = self.indexer.select(iq[prefill], iw[prefill], rows.page_table, rows.seqs, rows.positions,
                                           rows.n_pools, cache, layer)
            out[prefill] = self._attend(q_abs[prefill], pool_ids, rows.positions, rows.page_table, rows.seqs,
                                        cache)
        if batch.snapshot_saves is not None:
            batch.snapshot_saves.save_dsa(open_pool, layer)
        if batch.one_token_spans:  # decoding requests in a mixed step: one pass of the decode path for them all
            one = batch.one_token_rows
            out[one] = self._attend_decode(q_abs[one], latent[one], iq[one], iw[one], ikg[one], batch.one_token,
                                           open_pool, cache)
        return out

    def _attend(self, q_abs: torch.Tensor, pool_ids: torch.Tensor, positions: torch.Tensor,
                page_table: torch.Tensor, seqs: torch.Tensor | None, cache: PagedLatents) -> torch.Tensor:
        cfg = self.cfg
        latents, scales = cache.layer_latents(self.cache_index)
        return kernel("sparse_mla", q_abs.device.type)(
            q_abs, latents, pool_ids, positions, page_table, seqs, cache.page_size, cfg.index_kpool,
            cfg.qk_nope_head_dim ** -0.5, cfg.index_always_select_tail, latent_scales=scales)
