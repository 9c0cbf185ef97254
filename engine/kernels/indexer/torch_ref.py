"""Portable indexer, mirroring the reference's dtypes: pooled keys in the activation dtype, scores fp32."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register


@register("index_pool", "torch")
def index_pool(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Complete pools -> pooled keys. keys, gates [P, kpool, d]; ape [kpool, d] fp32 -> [P, d]."""
    probs = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


@register("index_select", "torch")
def index_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, visible: torch.Tensor,
                 select: int) -> torch.Tensor:
    """Top pools per query. q [T, Hi, d]; weights [T, Hi] fp32 (already scaled by Hi^-0.5);
    pool_keys [P, d] shared by all queries, or [T, P, d] one set per query (a decode batch);
    visible [T] = number of complete pools each query may see.

    Returns pool ids [T, min(select, P)], -1 where the query sees fewer pools than that.
    """
    n_pools = pool_keys.shape[-2]
    width = min(select, n_pools)
    if width == 0:
        return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    scores = torch.relu((q.float() @ pool_keys.float().transpose(-1, -2)) * q.shape[-1] ** -0.5)  # [T, Hi, P]
    index = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # [T, P]
    ok = torch.arange(n_pools, device=q.device) < visible.unsqueeze(-1)
    index = index.masked_fill(~ok, torch.finfo(index.dtype).min)
    # Pools whose heads all clip to zero tie exactly; a stable sort breaks ties toward the earlier pool,
    # so the choice never depends on how many pools the row holds (decode scans a fixed-width row).
    chosen = index.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    return chosen.masked_fill(~ok.gather(-1, chosen), -1)
