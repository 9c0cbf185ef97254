"""Portable indexer, mirroring the reference's dtypes: pooled keys in the activation dtype, scores fp32."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register
from engine.quant import dequantize_fp8_groups

QUERY_BLOCK = 256  # queries whose gathered pool keys are held at once: [block, pools, d]


@register("index_pool", "torch")
def index_pool(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Complete pools -> pooled keys. keys, gates [P, kpool, d]; ape [kpool, d] fp32 -> [P, d]."""
    probs = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def pool_scores(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor) -> torch.Tensor:
    """Index scores [T, P] fp32: sum over heads of weight x relu(q . key / sqrt(d)). q [T, Hi, d]; weights
    [T, Hi] fp32 (already scaled by Hi^-0.5); pool_keys [T, P, d], one row of pools per query."""
    scores = torch.relu((q.float() @ pool_keys.float().transpose(-1, -2)) * q.shape[-1] ** -0.5)  # [T, Hi, P]
    return torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)


def top_pools(scores: torch.Tensor, visible: torch.Tensor, select: int) -> torch.Tensor:
    """Pool ids [T, min(select, P)] of the highest scores [T, P] among each query's `visible` first pools, best
    first, -1 where it sees fewer than that. A full sort, not a top-k: at decode's shapes (one row of 1k-32k pools)
    the stable sort took 57 us at 1k and 88 us at 32k on an H100, top-k over unique keys 126 and 262 us."""
    width = min(select, scores.shape[-1])
    ok = torch.arange(scores.shape[-1], device=scores.device) < visible.unsqueeze(-1)
    scores = scores.masked_fill(~ok, torch.finfo(scores.dtype).min)
    # Pools whose heads all clip to zero tie exactly; a stable sort breaks ties toward the earlier pool,
    # so the choice never depends on how many pools the row holds (decode scans a fixed-width row).
    chosen = scores.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    return chosen.masked_fill(~ok.gather(-1, chosen), -1)


def every_visible_pool(positions: torch.Tensor, n_pools: int, kpool: int) -> torch.Tensor:
    """Pool ids [T, n_pools] where a row may choose every pool (n_pools <= select): its pools complete before its
    position in id order, -1 after. The same set top_pools chooses, without scoring or sorting a pool (attention
    over the chosen pools does not depend on their order beyond summation order)."""
    ids = torch.arange(n_pools, device=positions.device).expand(positions.shape[0], -1)
    return ids.masked_fill(ids >= ((positions + 1) // kpool).unsqueeze(-1), -1)


@register("index_select", "torch")
def index_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, page_table: torch.Tensor,
                 seqs: torch.Tensor | None, positions: torch.Tensor, n_pools: int, per_page: int, kpool: int,
                 select: int, key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Top pools per query, over the paged pooled-key cache.

    q [T, Hi, d]; weights [T, Hi] fp32; pool_keys [rows, d] (one layer's cache); page_table [S, pages]; seqs [T]
    the page-table row of each query (None: row i for query i); positions [T]; n_pools: the pools each row
    scores (at most pages x per_page; a query sees the complete ones up to its position); key_scales [rows, G]
    fp32 where the cache is fp8 (`engine.quant.quantize_fp8_groups`).
    Returns pool ids [T, min(select, n_pools)], -1 where the query sees fewer pools than that.
    """
    if n_pools <= select:
        return every_visible_pool(positions, n_pools, kpool)
    tables = page_table if seqs is None else page_table[seqs]
    every_pool = torch.arange(n_pools, device=q.device)
    scores = torch.empty(q.shape[0], n_pools, dtype=torch.float32, device=q.device)
    for b0 in range(0, q.shape[0], QUERY_BLOCK):
        sl = slice(b0, b0 + QUERY_BLOCK)
        pools = every_pool.expand(tables[sl].shape[0], -1)
        rows = tables[sl].gather(1, pools // per_page) * per_page + pools % per_page
        keys = pool_keys[rows] if key_scales is None else \
            dequantize_fp8_groups(pool_keys[rows], key_scales[rows], q.dtype)
        scores[sl] = pool_scores(q[sl], weights[sl], keys)
    return top_pools(scores, (positions + 1) // kpool, select)
