"""Sparse MLA on CUDA over the paged latent cache: one program per query token and block of heads walks the
tokens the indexer selected (and the tail), gathering latent rows through the page table, with an online
softmax. Decode and the spans of a prefill step are the same launch (a query names its page-table row), so a
step attends for all its sequences at once; the work per query is fixed by the selection (index_topk tokens),
not by the context length. Few queries (decode) split the selected tokens over programs and combine after."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.token_variants import token_variants

MAX_SPLITS = 32
FEW_QUERIES = 4  # from this many queries a step, the release's shape over a bf16 cache takes every head a program
TARGET_PROGRAMS = 264  # two waves of an H100/H200's 132 SMs
_SHAPES_RUN: set[tuple[int, int, int, bool]] = set()  # (heads, rank, kpool, fp8 cache) of the layers run so far


@dataclass(frozen=True)
class MlaLaunch:
    """A launch's tiling: heads a program holds, selected tokens an iteration, warps, and the loop's pipeline
    stages (the gathered rows are copied that many iterations ahead)."""

    block_h: int = 32
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 3


def launch_config(heads: int, rank: int, fp8: bool, queries: int) -> MlaLaunch:
    """The tiling by the layer's shape, cache and the step's query count. At the release's shape (64 heads x 512)
    every head in one program, so a gathered row is read once a query, in two stages; an fp8 cache's 1-byte rows
    take 64 a stage. Measured on an H100 (ops.bench_dsa): a 2,048-token span 4.96 ms (bf16) and 3.71 ms (fp8)
    against 10.6 and 10.6-19.7 at 32 heads x 32 tokens; decode B=64 261 against 374 us, B=8 66 against 69, the fp8
    cache at B=1 34 us. Below FEW_QUERIES a bf16 cache keeps 32 heads a program, its tokens split over more programs
    (B=1: 33 against 36-40 us). Smaller shapes: 32 heads (16 for fewer), fewer warps for narrow latents."""
    if heads >= 64 and rank >= 256 and (fp8 or queries >= FEW_QUERIES):
        return MlaLaunch(block_h=64, block_n=64 if fp8 else 32, num_warps=8, num_stages=2)
    return MlaLaunch(block_h=32 if heads >= 32 else 16, num_warps=8 if rank >= 256 else 4)


@triton.jit
def _attend_block(q, m, l, acc, n0, end, t, seq, pos, tail_start, lat_ptr, lat_scale_ptr, pool_ptr, table_ptr, W,
                  page_size, stride_pool, stride_table, scale, R: tl.constexpr, KPOOL: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SCALE_GROUPS: tl.constexpr):
    """Selected tokens n0 .. n0 + BLOCK_N of query t (its pools, then its tail) gathered through the page table
    and folded into the online softmax (m, l) and the sum acc [BLOCK_H, R]."""
    cols = tl.arange(0, R)
    j = n0 + tl.arange(0, BLOCK_N)
    in_pools = j < W * KPOOL
    pool = tl.load(pool_ptr + t * stride_pool + j // KPOOL, mask=in_pools, other=-1)
    tail = tail_start + j - W * KPOOL
    # Booleans combined with & and | (a tl.where between two i1 tensors breaks a layout pass on sm_90).
    valid = ((in_pools & (pool >= 0)) | ((j >= W * KPOOL) & (tail <= pos))) & (j < end)
    token = tl.where(valid, tl.where(in_pools, pool * KPOOL + j % KPOOL, tail), 0)
    page = tl.load(table_ptr + seq * stride_table + token // page_size, mask=valid, other=0)
    row = page * page_size + token % page_size
    k = tl.load(lat_ptr + row[:, None] * R + cols[None, :], mask=valid[:, None], other=0.0)
    if SCALE_GROUPS:  # an fp8 cache: each row's groups of R // SCALE_GROUPS elements times their scale
        groups = tl.arange(0, SCALE_GROUPS)
        k_scale = tl.load(lat_scale_ptr + row[:, None] * SCALE_GROUPS + groups[None, :], mask=valid[:, None],
                          other=0.0)  # [BLOCK_N, SCALE_GROUPS]: one load a group, not one an element
        k = tl.reshape(tl.reshape(k.to(tl.float32), [BLOCK_N, SCALE_GROUPS, R // SCALE_GROUPS])
                       * k_scale[:, :, None], [BLOCK_N, R]).to(q.dtype)
    if DOT_F32:  # fp32 activations (tf32 would lose ~3 digits) and the interpreter (no 16-bit tl.dot)
        k = k.to(tl.float32)
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing selected yet adds nothing
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l, acc


# Per-step counts, widths and index views (sliced at any offset from one packed copy): one build for all steps.
@triton.jit(do_not_specialize=["T", "W", "L", "chunk", "stride_pool", "stride_table"],
            do_not_specialize_on_alignment=["pool_ptr", "pos_ptr", "table_ptr", "seq_ptr"])
def _sparse_mla_kernel(q_ptr, lat_ptr, lat_scale_ptr, pool_ptr, pos_ptr, table_ptr, seq_ptr, out_ptr, m_ptr, l_ptr,
                       T, H, W, L, chunk, page_size, stride_qt, stride_qh, stride_pool, stride_table, scale,
                       R: tl.constexpr, KPOOL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_SEQS: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                       SCALE_GROUPS: tl.constexpr, PIPELINED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < H
    cols = tl.arange(0, R)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :], mask=h_ok[:, None], other=0.0)
    pos = tl.load(pos_ptr + t)
    if HAS_SEQS:
        seq = tl.load(seq_ptr + t)
    else:
        seq = t
    tail_start = (pos + 1) // KPOOL * KPOOL
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, L)
    if PIPELINED:  # a for loop: Triton copies the gathered rows of later iterations ahead
        for n0 in tl.range(start, end, BLOCK_N):
            m, l, acc = _attend_block(q, m, l, acc, n0, end, t, seq, pos, tail_start, lat_ptr, lat_scale_ptr, pool_ptr,
                                      table_ptr, W, page_size, stride_pool, stride_table, scale, R, KPOOL, BLOCK_N,
                                      DOT_F32, SCALE_GROUPS)
    else:  # Triton 3.6's interpreter (the CPU tests) takes no runtime bound in a for loop
        n0 = start
        while n0 < end:
            m, l, acc = _attend_block(q, m, l, acc, n0, end, t, seq, pos, tail_start, lat_ptr, lat_scale_ptr, pool_ptr,
                                      table_ptr, W, page_size, stride_pool, stride_table, scale, R, KPOOL, BLOCK_N,
                                      DOT_F32, SCALE_GROUPS)
            n0 += BLOCK_N
    if SPLIT:  # partial sums [splits, T, H, R] and their max / sum [splits, T, H], combined below
        at = (split * T + t) * H + heads
        tl.store(out_ptr + at[:, None] * R + cols[None, :], acc, mask=h_ok[:, None])
        tl.store(m_ptr + at, m, mask=h_ok)
        tl.store(l_ptr + at, l, mask=h_ok)
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        at = t * H + heads
        tl.store(out_ptr + at[:, None] * R + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit(do_not_specialize=["TH", "splits"])
def _combine_kernel(part_ptr, m_ptr, l_ptr, out_ptr, TH, splits, R: tl.constexpr, SPLITS: tl.constexpr):
    """One (token, head): the splits' partial sums rescaled to their common max."""
    at = tl.program_id(0).to(tl.int64)
    which = tl.arange(0, SPLITS)
    m = tl.load(m_ptr + which * TH + at, mask=which < splits, other=float("-inf"))
    l = tl.load(l_ptr + which * TH + at, mask=which < splits, other=0.0)
    top = tl.max(m, axis=0)
    scale = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(scale * l, axis=0)
    cols = tl.arange(0, R)
    acc = tl.zeros([R], tl.float32)
    s = 0
    while s < splits:
        weight = tl.sum(tl.where(which == s, scale, 0.0), axis=0)
        acc += weight * tl.load(part_ptr + (s * TH + at) * R + cols)
        s += 1
    tl.store(out_ptr + at * R + cols, (acc / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty))


def _splits(queries: int, head_blocks: int, keys: int, block_n: int) -> int:
    """Programs a query's selected tokens are spread over: enough for two waves when few queries run."""
    return max(1, min(MAX_SPLITS, triton.cdiv(keys, block_n), triton.cdiv(TARGET_PROGRAMS, queries * head_blocks)))


@token_variants
def _builds(tokens: int) -> tuple:
    """A prefill of one span of `tokens` new tokens takes its tiling by the query count and splits its queries'
    selected tokens over programs (and combines them) when they are few: builds of their own (decode batches,
    captured at start, take theirs)."""
    builds = []
    for heads, rank, kpool, fp8 in sorted(_SHAPES_RUN):
        launch = launch_config(heads, rank, fp8, tokens)
        head_blocks = triton.cdiv(heads, launch.block_h)
        split = _splits(tokens, head_blocks, tokens + kpool - 1, launch.block_n) > 1
        builds.append(((heads, rank, kpool, fp8), launch, split))
    return tuple(builds)


@register("sparse_mla", "triton")
def sparse_mla(q_latent: torch.Tensor, latents: torch.Tensor, pool_ids: torch.Tensor, positions: torch.Tensor,
               page_table: torch.Tensor, seqs: torch.Tensor | None, page_size: int, kpool: int, scale: float,
               with_tail: bool, latent_scales: torch.Tensor | None = None, *,
               launch: MlaLaunch | None = None) -> torch.Tensor:
    """As the torch reference (engine.kernels.sparse_mla.torch_ref.sparse_mla), scores in fp32; an fp8 cache's
    rows dequantized to the activations' dtype as they are read. `launch` overrides the tiling."""
    t, h, r = q_latent.shape
    # Written as contiguous [T, H, R] (empty_like would keep the strides of a permuted einsum output).
    out = torch.empty(t, h, r, dtype=q_latent.dtype, device=q_latent.device)
    if t == 0:
        return out
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    w = pool_ids.shape[1]
    keys = w * kpool + (kpool - 1 if with_tail else 0)
    fp8 = latent_scales is not None
    _SHAPES_RUN.add((h, r, kpool, fp8))
    launch = launch or launch_config(h, r, fp8, t)
    head_blocks = triton.cdiv(h, launch.block_h)
    splits = _splits(t, head_blocks, keys, launch.block_n)
    chunk = triton.cdiv(triton.cdiv(keys, splits), launch.block_n) * launch.block_n
    splits = max(1, triton.cdiv(keys, chunk))
    meta = dict(R=r, KPOOL=kpool, BLOCK_H=launch.block_h, BLOCK_N=launch.block_n, HAS_SEQS=seqs is not None,
                DOT_F32=not (q_latent.is_cuda and q_latent.dtype in (torch.bfloat16, torch.float16)),
                SCALE_GROUPS=0 if latent_scales is None else latent_scales.shape[-1], PIPELINED=q_latent.is_cuda,
                num_warps=launch.num_warps,
                num_stages=launch.num_stages)
    args = (q_latent, latents, latents if latent_scales is None else latent_scales, pool_ids, positions, page_table,
            positions if seqs is None else seqs)
    shape = (t, h, w, keys, chunk, page_size, q_latent.stride(0), q_latent.stride(1), pool_ids.stride(0),
             page_table.stride(0), scale)
    if splits == 1:
        _sparse_mla_kernel[(t, head_blocks, 1)](*args, out, out, out, *shape, SPLIT=False, **meta)
        return out
    parts = torch.empty(splits, t, h, r, dtype=torch.float32, device=q_latent.device)
    maxes = torch.empty(splits, t, h, dtype=torch.float32, device=q_latent.device)
    sums = torch.empty_like(maxes)
    _sparse_mla_kernel[(t, head_blocks, splits)](*args, parts, maxes, sums, *shape, SPLIT=True, **meta)
    _combine_kernel[(t * h,)](parts, maxes, sums, out, t * h, splits, R=r, SPLITS=MAX_SPLITS, num_warps=4)
    return out
