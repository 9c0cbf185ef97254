"""Portable sparse MLA over the paged latent cache: each query reads only the tokens its pools and tail name."""

from __future__ import annotations

import torch

from engine.kernels.dispatch import register
from engine.quant import dequantize_fp8_groups

QUERY_BLOCK = 64  # queries whose gathered keys are held at once: [block, keys, R]


def attended_tokens(pool_ids: torch.Tensor, positions: torch.Tensor, kpool: int,
                    with_tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(token positions [T, L], valid [T, L]) each query attends: the tokens of its selected pools (-1 = none),
    then, with the tail, the incomplete pool's tokens up to the query itself. L = W * kpool (+ kpool - 1)."""
    offsets = torch.arange(kpool, device=positions.device)
    tokens = (pool_ids.unsqueeze(-1) * kpool + offsets).flatten(1)  # [T, W * kpool]
    valid = (pool_ids >= 0).repeat_interleave(kpool, dim=1)
    if with_tail:
        tail = ((positions + 1) // kpool * kpool).unsqueeze(1) + offsets[:-1]
        tokens = torch.cat([tokens, tail], dim=1)
        valid = torch.cat([valid, tail <= positions.unsqueeze(1)], dim=1)
    return tokens.masked_fill(~valid, 0), valid


@register("sparse_mla", "torch")
def sparse_mla(q_latent: torch.Tensor, latents: torch.Tensor, pool_ids: torch.Tensor, positions: torch.Tensor,
               page_table: torch.Tensor, seqs: torch.Tensor | None, page_size: int, kpool: int, scale: float,
               with_tail: bool, latent_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Queries of any number of sequences (a decode batch, or the spans of a prefill step), each reading only
    its selected tokens from the paged cache.

    q_latent [T, H, R] (queries absorbed into the latent space); latents [rows, R] (one layer's paged cache);
    pool_ids [T, W] (-1 = none); positions [T] absolute; page_table [S, pages]; seqs [T] the page-table row of
    each query (None: row i for query i, a decode batch); latent_scales [rows, G] fp32 where the cache is fp8
    (`engine.quant.quantize_fp8_groups`). Shapes depend only on T, so a decode step can be graph-captured.
    Returns the latent outputs [T, H, R].
    """
    tables = page_table if seqs is None else page_table[seqs]
    out = torch.empty_like(q_latent)
    for b0 in range(0, q_latent.shape[0], QUERY_BLOCK):
        sl = slice(b0, b0 + QUERY_BLOCK)
        tokens, valid = attended_tokens(pool_ids[sl], positions[sl], kpool, with_tail)
        rows = tables[sl].gather(1, tokens // page_size) * page_size + tokens % page_size
        keys = latents[rows] if latent_scales is None else \
            dequantize_fp8_groups(latents[rows], latent_scales[rows], q_latent.dtype)  # [t, L, R]
        scores = torch.einsum("bhr,blr->bhl", q_latent[sl], keys) * scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
        out[sl] = torch.einsum("bhl,blr->bhr", probs, keys)
    return out
