"""Fused mHC for CUDA: the mixing weights, Sinkhorn and collapse in two launches, the combine in one.

mhc_pre is memory-bound on `fn` at decode (24 x S*D weights per site, 90 sites per token), so the
S*D reduction is split over many programs that each write a partial [24] dot and a partial sum of
squares; a second kernel sums the partials, applies the norm, gates and Sinkhorn in fp32 and does
the collapse, parallel over D. For prefill, programs tile tokens so `fn` is read once per tile.
Shapes decide every launch parameter, so both ops are CUDA-graph capturable. Nothing a kernel is built
for depends on the token count beyond its token tile (up to 16 tokens, or more): K splits have one size,
the D split is a runtime value, so the start's warm-up builds every variant a request can meet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register

_TARGET_PROGRAMS = 256  # about two programs per SM on an H200 (132 SMs)
_K_SPLIT = 128  # columns of x per partial program, whatever T: 128 partials at S * D = 16,384


@triton.jit(do_not_specialize=["T"])
def _pre_partial_kernel(x_ptr, fn_ptr, dot_ptr, sq_ptr, T, K,
                        CHUNK: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        NATIVE_DOT: tl.constexpr):
    """Program (token tile, K split): partial x @ fn^T [BT, NP] and partial sum(x^2) [BT] over CHUNK columns."""
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, NP)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BT, NP], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)
    k_start = pid_k * CHUNK
    for k0 in range(0, CHUNK, BK):
        ks = k_start + k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(fn_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & k_ok[:, None], other=0.0)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        if NATIVE_DOT:  # 16-bit x 16-bit products are exact in the fp32 accumulator
            acc = tl.dot(x, w, acc)
        else:
            acc = tl.dot(xf, w.to(tl.float32), acc, input_precision="ieee")
    out = pid_k * T + rows
    tl.store(dot_ptr + out.to(tl.int64)[:, None] * NP + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + out, sq, mask=row_ok)


@triton.jit(do_not_specialize=["T", "SPLITS", "D_CHUNK"])
def _pre_finish_kernel(x_ptr, dot_ptr, sq_ptr, base_ptr, scale_ptr, u_ptr, post_ptr, comb_ptr,
                       T, D, SPLITS, eps, hc_eps, D_CHUNK, ITERS: tl.constexpr,
                       S: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr, SPLITS_P: tl.constexpr,
                       BD: tl.constexpr):
    """Program (token, D chunk): reduce the partials, gates + Sinkhorn in fp32, collapse its D chunk."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    K = S * D
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < SPLITS
    a = tl.arange(0, SP)
    a_ok = a < S
    pair_ok = a_ok[:, None] & a_ok[None, :]
    part = dot_ptr + (sp.to(tl.int64) * T + t) * NP

    sq = tl.sum(tl.load(sq_ptr + sp * T + t, mask=sp_ok, other=0.0), axis=0)
    r = tl.rsqrt(sq / K + eps)
    vec_mask = sp_ok[:, None] & a_ok[None, :]
    m_pre = tl.sum(tl.load(part[:, None] + a[None, :], mask=vec_mask, other=0.0), axis=0) * r
    m_post = tl.sum(tl.load(part[:, None] + S + a[None, :], mask=vec_mask, other=0.0), axis=0) * r
    comb_off = 2 * S + a[:, None] * S + a[None, :]  # [a, b], row-major as in the checkpoint
    m_comb = tl.sum(tl.load(part[:, None, None] + comb_off[None, :, :],
                            mask=sp_ok[:, None, None] & pair_ok[None, :, :], other=0.0), axis=0) * r

    scale_pre = tl.load(scale_ptr).to(tl.float32)
    scale_post = tl.load(scale_ptr + 1).to(tl.float32)
    scale_comb = tl.load(scale_ptr + 2).to(tl.float32)
    pre = tl.sigmoid(m_pre * scale_pre + tl.load(base_ptr + a, mask=a_ok, other=0.0).to(tl.float32)) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * scale_post + tl.load(base_ptr + S + a, mask=a_ok, other=0.0).to(tl.float32))
    logits = m_comb * scale_comb + tl.load(base_ptr + comb_off, mask=pair_ok, other=0.0).to(tl.float32)
    logits = tl.where(pair_ok, logits, -1e30)  # finite, so padded rows never form inf - inf
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(pair_ok, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # one column pass first
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)

    first = pid_d == 0
    tl.store(post_ptr + t * S + a, post, mask=a_ok & first)
    tl.store(comb_ptr + t * S * S + a[:, None] * S + a[None, :], comb, mask=pair_ok & first)

    h_rows = x_ptr + t.to(tl.int64) * K + a[:, None] * D
    d0 = pid_d * D_CHUNK
    d_end = d0 + D_CHUNK
    while d0 < d_end:  # a runtime bound: a while loop (the interpreter takes no runtime range)
        d = d0 + tl.arange(0, BD)
        d_ok = d < D
        h = tl.load(h_rows + d[None, :], mask=a_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        u = tl.sum(pre[:, None] * h, axis=0)
        tl.store(u_ptr + t.to(tl.int64) * D + d, u.to(u_ptr.dtype.element_ty), mask=d_ok)
        d0 += BD


@triton.jit
def _post_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, D,
                 S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    """Program (token, D tile): y[b] = post[b]*o + sum_a comb[a,b]*x[a], rounded where the torch path rounds."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < D
    b = tl.arange(0, SP)
    b_ok = b < S
    act = y_ptr.dtype.element_ty
    row = t.to(tl.int64) * S * D
    post = tl.load(post_ptr + t * S + b, mask=b_ok, other=0.0).to(act).to(tl.float32)
    o = tl.load(o_ptr + t.to(tl.int64) * D + d, mask=d_ok, other=0.0).to(act).to(tl.float32)
    head = (post[:, None] * o[None, :]).to(act).to(tl.float32)
    mix = tl.zeros([SP, BD], dtype=tl.float32)
    for a in tl.static_range(S):
        h = tl.load(x_ptr + row + a * D + d, mask=d_ok, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + (t * S + a) * S + b, mask=b_ok, other=0.0).to(act).to(tl.float32)
        mix += c[:, None] * h[None, :]
    y = head + mix.to(act).to(tl.float32)
    tl.store(y_ptr + row + b[:, None] * D + d[None, :], y.to(act), mask=b_ok[:, None] & d_ok[None, :])


def _split(length: int, block: int, others: int) -> tuple[int, int]:
    """(pieces, chunk): cut `length` into block-aligned chunks so others * pieces is near the program target."""
    pieces = min(triton.next_power_of_2(triton.cdiv(_TARGET_PROGRAMS, max(others, 1))), triton.cdiv(length, block))
    chunk = triton.cdiv(triton.cdiv(length, pieces), block) * block
    return triton.cdiv(length, chunk), chunk


@register("mhc_pre", "triton")
def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> (sublayer input [T, D], post [T, S] fp32, comb [T, S, S] fp32 indexed [a, b])."""
    t, s, d = streams.shape
    k, n = s * d, (2 + s) * s
    x, fn = streams.contiguous(), fn.contiguous()
    dev = x.device
    # The interpreter (CPU tensors) multiplies 16-bit floats' bit patterns in tl.dot, so it takes the fp32 path.
    native = x.is_cuda and x.dtype == fn.dtype and x.dtype in (torch.bfloat16, torch.float16)
    bt = 16 if t <= 16 else 64
    # An fp32 operand goes through FMA dots that hold whole K slices in registers: narrower K blocks there.
    bk = (128 if t <= 16 else 64) if native else 32
    n_t = triton.cdiv(t, bt)
    chunk = min(_K_SPLIT, triton.next_power_of_2(k))
    splits = triton.cdiv(k, chunk)
    np_ = max(16, triton.next_power_of_2(n))  # tl.dot needs N >= 16
    dots = torch.empty(splits, t, np_, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, t, dtype=torch.float32, device=dev)
    _pre_partial_kernel[(n_t, splits)](x, fn, dots, sq, t, k, CHUNK=chunk, N=n, NP=np_, BT=bt, BK=bk,
                                        NATIVE_DOT=native, num_warps=4, num_stages=2 if t <= 16 else 3)
    u = torch.empty(t, d, dtype=x.dtype, device=dev)
    post = torch.empty(t, s, dtype=torch.float32, device=dev)
    comb = torch.empty(t, s, s, dtype=torch.float32, device=dev)
    bd = 256
    d_splits, d_chunk = _split(d, bd, t)
    # One warp: the 4 x 4 Sinkhorn reductions stay in warp shuffles, no barriers on the serial chain.
    _pre_finish_kernel[(t, d_splits)](x, dots, sq, base, scale, u, post, comb, t, d, splits, eps, hc_eps, d_chunk,
                                      ITERS=sinkhorn_iters, S=s, SP=triton.next_power_of_2(s), NP=np_,
                                      SPLITS_P=triton.next_power_of_2(splits), BD=bd, num_warps=1)
    return u, post, comb


@register("mhc_post", "triton")
def mhc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H_new[:, b] = post[b] * out + sum_a comb[a, b] * H[:, a], in the activation dtype."""
    t, s, d = streams.shape
    x = streams.contiguous()
    y = torch.empty_like(x)
    bd, warps = (256, 2) if t <= 16 else (1024, 4)
    _post_kernel[(t, triton.cdiv(d, bd))](x, out.contiguous(), post.contiguous(), comb.contiguous(), y, d,
                                          S=s, SP=triton.next_power_of_2(s), BD=bd, num_warps=warps)
    return y
