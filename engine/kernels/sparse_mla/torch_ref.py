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


@register("sparse_mla_decode", "torch")
def sparse_mla_decode(q_latent: torch.Tensor, latents: torch.Tensor, pool_ids: torch.Tensor, positions: torch.Tensor,
                      page_table: torch.Tensor, page_size: int, kpool: int, scale: float,
                      with_tail: bool) -> torch.Tensor:
    """One new token for each of B requests, reading only the selected positions from the paged cache.

    q_latent [B, H, R]; latents [rows, R] (one layer's paged cache); pool_ids [B, W] (-1 = none);
    positions [B]; page_table [B, pages]. Shapes depend only on B, so the step can be graph-captured.
    Returns the latent outputs [B, H, R].
    """
    offsets = torch.arange(kpool, device=positions.device)
    tokens = (pool_ids.unsqueeze(-1) * kpool + offsets).flatten(1)  # [B, W * kpool]
    valid = (pool_ids >= 0).repeat_interleave(kpool, dim=1)
    if with_tail:  # the raw tokens of the pool the query sits in, up to the query itself
        tail = ((positions + 1) // kpool * kpool).unsqueeze(1) + offsets[:-1]
        tokens = torch.cat([tokens, tail], dim=1)
        valid = torch.cat([valid, tail <= positions.unsqueeze(1)], dim=1)
    tokens = tokens.masked_fill(~valid, 0)
    keys = latents[page_table.gather(1, tokens // page_size) * page_size + tokens % page_size]  # [B, L, R]
    scores = torch.einsum("bhr,blr->bhl", q_latent, keys) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    return torch.einsum("bhl,blr->bhr", probs, keys)
