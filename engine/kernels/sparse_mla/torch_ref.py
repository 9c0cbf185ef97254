"""Portable sparse MLA: a dense masked attention over the sequence's latents, in query blocks."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register

QUERY_BLOCK = 256


def selection_mask(pool_ids: torch.Tensor, positions: torch.Tensor, kpool: int, n_keys: int,
                   with_tail: bool) -> torch.Tensor:
    """[T, n_keys] bool: tokens of the selected pools, plus the incomplete pool's tokens up to the query."""
    t = positions.shape[0]
    n_pools = n_keys // kpool
    pools = torch.zeros(t, n_pools + 1, dtype=torch.bool, device=positions.device)
    pools.scatter_(1, torch.where(pool_ids >= 0, pool_ids, n_pools), True)  # column n_pools collects the -1s
    mask = pools[:, :-1].repeat_interleave(kpool, dim=1)
    mask = torch.nn.functional.pad(mask, (0, n_keys - mask.shape[1]))
    if with_tail:
        keys = torch.arange(n_keys, device=positions.device)
        tail_start = (positions + 1) // kpool * kpool
        mask |= (keys >= tail_start[:, None]) & (keys <= positions[:, None])
    return mask


@register("sparse_mla", "torch")
def sparse_mla(q_latent: torch.Tensor, latents: torch.Tensor, pool_ids: torch.Tensor, positions: torch.Tensor,
               kpool: int, scale: float, with_tail: bool) -> torch.Tensor:
    """One sequence. q_latent [T, H, R] (queries absorbed into the latent space); latents [N, R];
    pool_ids [T, K] (-1 = none); positions [T] absolute. Returns the latent outputs [T, H, R]."""
    out = torch.empty_like(q_latent)
    for b0 in range(0, q_latent.shape[0], QUERY_BLOCK):
        sl = slice(b0, b0 + QUERY_BLOCK)
        mask = selection_mask(pool_ids[sl], positions[sl], kpool, latents.shape[0], with_tail)
        scores = torch.einsum("thr,nr->thn", q_latent[sl], latents) * scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
        out[sl] = torch.einsum("thn,nr->thr", probs, latents)
    return out
