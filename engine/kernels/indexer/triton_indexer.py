"""The indexer's pool scores on CUDA: one program per query and block of pools reads the pooled keys through the
page table and reduces the heads in registers, for every sequence of a step in one launch (the torch path
gathers each query's pool keys first). The choice is the reference's `top_pools` (a top-k over unique keys that
breaks ties as a stable sort would); a row that may choose every pool (up to index_topk tokens of context) is
neither scored nor ranked."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.indexer.torch_ref import every_visible_pool, top_pools

BLOCK_P = 64  # pools per program


# Per-step counts, widths and index views (sliced at any offset from one packed copy): one build for all steps.
@triton.jit(do_not_specialize=["n_pools", "stride_table", "stride_out"],
            do_not_specialize_on_alignment=["table_ptr", "seq_ptr", "pos_ptr"])
def _pool_scores_kernel(q_ptr, w_ptr, keys_ptr, key_scale_ptr, table_ptr, seq_ptr, pos_ptr, out_ptr, HI, n_pools,
                        per_page, stride_qt, stride_qh, stride_wt, stride_keys, stride_table, stride_out, scale,
                        D: tl.constexpr, KPOOL: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_P: tl.constexpr,
                        HAS_SEQS: tl.constexpr, DOT_F32: tl.constexpr, SCALE_GROUPS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pools = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    heads = tl.arange(0, BLOCK_HI)
    dims = tl.arange(0, D)
    if HAS_SEQS:
        seq = tl.load(seq_ptr + t)
    else:
        seq = t
    visible = (tl.load(pos_ptr + t) + 1) // KPOOL  # the complete pools before the query; top_pools masks the rest
    if tl.program_id(1) * BLOCK_P < visible:  # a block past them is left unwritten (a prompt's later half, causal)
        seen = pools < visible
        page = tl.load(table_ptr + seq * stride_table + pools // per_page, mask=seen, other=0)
        rows = page * per_page + pools % per_page
        keys = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=seen[:, None], other=0.0)
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=(heads < HI)[:, None],
                    other=0.0)
        weights = tl.load(w_ptr + t * stride_wt + heads, mask=heads < HI, other=0.0)
        if SCALE_GROUPS:  # an fp8 cache: each key's groups of D // SCALE_GROUPS elements times their scale
            key_scale = tl.load(key_scale_ptr + rows[:, None] * SCALE_GROUPS + dims[None, :] // (D // SCALE_GROUPS),
                                mask=seen[:, None], other=0.0)
            keys = (keys.to(tl.float32) * key_scale).to(q.dtype)
        if DOT_F32:  # fp32 activations and the interpreter (no 16-bit tl.dot); 16-bit products are exact in fp32
            dots = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(q, tl.trans(keys))
        scores = tl.maximum(dots * scale, 0.0)  # [heads, pools]
        index = tl.sum(weights[:, None] * scores, axis=0)
        tl.store(out_ptr + t * stride_out + pools, index, mask=pools < n_pools)


@register("index_select", "triton")
def index_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, page_table: torch.Tensor,
                 seqs: torch.Tensor | None, positions: torch.Tensor, n_pools: int, per_page: int, kpool: int,
                 select: int, key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """As the torch reference (engine.kernels.indexer.torch_ref.index_select); an fp8 cache's keys dequantized to
    the queries' dtype as they are read."""
    if n_pools <= select:
        return every_visible_pool(positions, n_pools, kpool)
    t, hi, d = q.shape
    scores = torch.empty(t, n_pools, dtype=torch.float32, device=q.device)
    if t and n_pools:
        if q.stride(-1) != 1:
            q = q.contiguous()
        weights = weights.float()
        _pool_scores_kernel[(t, triton.cdiv(n_pools, BLOCK_P))](
            q, weights, pool_keys, pool_keys if key_scales is None else key_scales, page_table,
            positions if seqs is None else seqs, positions, scores, hi, n_pools,
            per_page, q.stride(0), q.stride(1), weights.stride(0), pool_keys.stride(0), page_table.stride(0),
            scores.stride(0), d ** -0.5, D=d, KPOOL=kpool, BLOCK_HI=max(16, triton.next_power_of_2(hi)),
            BLOCK_P=BLOCK_P, HAS_SEQS=seqs is not None,
            DOT_F32=not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)),
            SCALE_GROUPS=0 if key_scales is None else key_scales.shape[-1], num_warps=4)
    return top_pools(scores, (positions + 1) // kpool, select)
