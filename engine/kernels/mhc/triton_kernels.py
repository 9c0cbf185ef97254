"""Fused mHC for CUDA: the mixing weights, Sinkhorn, collapse and the sublayer's input norm in two launches;
the combine in one, which at decode also starts the next site's reduction.

mhc_pre is memory-bound on `fn` at decode (24 x S*D weights per site, 90 sites per token), so the
reduction over the streams is split over many programs, each owning a D chunk of every stream: it writes a
partial [24] dot and a partial Gram matrix of the streams (G[a, b] = h_a . h_b over its chunk). A second
kernel sums the partials; the Gram's trace is the streams' sum of squares (mHC's own norm) and pre^T G pre
is the collapsed row's, so the same launch applies the gates, Sinkhorn, the collapse and the RMSNorm of the
collapsed row, parallel over D. For prefill, programs tile tokens so `fn` is read once per tile.

At decode (up to 16 tokens) mhc_post, given the next site's `fn`, writes the new streams and that site's
partials from the same registers: the next mhc_pre is then one launch, so a layer's two sites cost four
launches, not the eight of combine, reduce, finish and norm apiece.
Shapes decide every launch parameter, so the ops are CUDA-graph capturable. Nothing a kernel is built
for depends on the token count beyond its token tile (up to 16 tokens, or more): the D split has one size
per tile, so the start's warm-up builds every variant a request can meet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.mhc import MhcPartials

_TARGET_PROGRAMS = 256  # about two programs per SM on an H200 (132 SMs)
DECODE_MAX_ROWS = 16  # up to this many tokens the combine computes the next site's partials too


def _pads(s: int) -> tuple[int, int, int]:
    """(mixes, their padded count, the Gram's padded count) for S streams; tl.dot needs N >= 16."""
    n = (2 + s) * s
    return n, max(16, triton.next_power_of_2(n)), triton.next_power_of_2(s * s)


@triton.jit(do_not_specialize=["T"])
def _pre_partial_kernel(x_ptr, fn_ptr, dot_ptr, gram_ptr, T, D,
                        CHUNK: tl.constexpr, S: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, GP: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """Program (token tile, D chunk): partial x @ fn^T [BT, NP] and partial Gram [BT, GP] over its chunk of every
    stream."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    K = S * D
    rows = pid_t * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, NP)
    gcols = tl.arange(0, GP)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BT, NP], dtype=tl.float32)
    gram = tl.zeros([BT, GP], dtype=tl.float32)
    d_start = pid_d * CHUNK
    for d0 in range(0, CHUNK, BK):
        ds = d_start + d0 + tl.arange(0, BK)
        mask = row_ok[:, None] & (ds < D)[None, :]
        for a in tl.static_range(S):
            x = tl.load(x_rows + a * D + ds[None, :], mask=mask, other=0.0)
            w = tl.load(fn_ptr + cols[None, :] * K + a * D + ds[:, None], mask=(cols[None, :] < N) & (ds < D)[:, None],
                        other=0.0)
            xf = x.to(tl.float32)
            if NATIVE_DOT:  # 16-bit x 16-bit products are exact in the fp32 accumulator
                acc = tl.dot(x, w, acc)
            else:
                acc = tl.dot(xf, w.to(tl.float32), acc, input_precision="ieee")
            for b in tl.static_range(a, S):
                if b == a:
                    other = xf
                else:
                    other = tl.load(x_rows + b * D + ds[None, :], mask=mask, other=0.0).to(tl.float32)
                gram += tl.where(gcols[None, :] == a * S + b, tl.sum(xf * other, axis=1)[:, None], 0.0)
    out = (pid_d * T + rows).to(tl.int64)
    tl.store(dot_ptr + out[:, None] * NP + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(gram_ptr + out[:, None] * GP + gcols[None, :], gram, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["T", "SPLITS", "D_CHUNK"])
def _pre_finish_kernel(x_ptr, dot_ptr, gram_ptr, base_ptr, scale_ptr, norm_ptr, u_ptr, post_ptr, comb_ptr,
                       T, D, SPLITS, eps, hc_eps, D_CHUNK, ITERS: tl.constexpr,
                       S: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr, GP: tl.constexpr,
                       SPLITS_P: tl.constexpr, BD: tl.constexpr):
    """Program (token, D chunk): reduce the partials, gates + Sinkhorn in fp32, collapse and norm its D chunk."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    K = S * D
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < SPLITS
    a = tl.arange(0, SP)
    a_ok = a < S
    pair_ok = a_ok[:, None] & a_ok[None, :]
    part = dot_ptr + (sp.to(tl.int64) * T + t) * NP
    pair_off = a[:, None] * S + a[None, :]  # [a, b], row-major as in the checkpoint
    gram = tl.sum(tl.load(gram_ptr + (sp.to(tl.int64) * T + t)[:, None, None] * GP + pair_off[None, :, :],
                          mask=sp_ok[:, None, None] & pair_ok[None, :, :], other=0.0), axis=0)  # upper triangle
    sq = tl.sum(tl.sum(tl.where(a[:, None] == a[None, :], gram, 0.0), axis=1), axis=0)
    r = tl.rsqrt(sq / K + eps)
    vec_mask = sp_ok[:, None] & a_ok[None, :]
    m_pre = tl.sum(tl.load(part[:, None] + a[None, :], mask=vec_mask, other=0.0), axis=0) * r
    m_post = tl.sum(tl.load(part[:, None] + S + a[None, :], mask=vec_mask, other=0.0), axis=0) * r
    comb_off = 2 * S + pair_off
    m_comb = tl.sum(tl.load(part[:, None, None] + comb_off[None, :, :],
                            mask=sp_ok[:, None, None] & pair_ok[None, :, :], other=0.0), axis=0) * r

    scale_pre = tl.load(scale_ptr).to(tl.float32)
    scale_post = tl.load(scale_ptr + 1).to(tl.float32)
    scale_comb = tl.load(scale_ptr + 2).to(tl.float32)
    pre = tl.sigmoid(m_pre * scale_pre + tl.load(base_ptr + a, mask=a_ok, other=0.0).to(tl.float32)) + hc_eps
    pre = tl.where(a_ok, pre, 0.0)
    post = 2.0 * tl.sigmoid(m_post * scale_post + tl.load(base_ptr + S + a, mask=a_ok, other=0.0).to(tl.float32))
    logits = m_comb * scale_comb + tl.load(base_ptr + comb_off, mask=pair_ok, other=0.0).to(tl.float32)
    logits = tl.where(pair_ok, logits, -1e30)  # finite, so padded rows never form inf - inf
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(pair_ok, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # one column pass first
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    # The collapsed row's sum of squares, pre^T G pre, from the Gram's upper triangle (off-diagonal terms twice).
    twice = tl.where(a[None, :] > a[:, None], 2.0, 1.0)
    u_sq = tl.sum(tl.sum(twice * pre[:, None] * pre[None, :] * gram, axis=1), axis=0)
    r_u = tl.rsqrt(u_sq / D + eps)

    first = pid_d == 0
    tl.store(post_ptr + t * S + a, post, mask=a_ok & first)
    tl.store(comb_ptr + t * S * S + pair_off, comb, mask=pair_ok & first)

    act = u_ptr.dtype.element_ty
    h_rows = x_ptr + t.to(tl.int64) * K + a[:, None] * D
    d0 = pid_d * D_CHUNK
    d_end = d0 + D_CHUNK
    while d0 < d_end:  # a runtime bound: a while loop (the interpreter takes no runtime range)
        d = d0 + tl.arange(0, BD)
        d_ok = d < D
        h = tl.load(h_rows + d[None, :], mask=a_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        # the reference's casts: collapse rounded, normalised and rounded, then the weight multiply rounded
        u = tl.sum(pre[:, None] * h, axis=0).to(act).to(tl.float32)
        w = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        normed = (u * r_u).to(act).to(tl.float32)
        tl.store(u_ptr + t.to(tl.int64) * D + d, (w * normed).to(act), mask=d_ok)
        d0 += BD


@triton.jit
def _combined_tile(x_ptr, o_ptr, post_ptr, comb_ptr, t, d, d_ok, D, act: tl.constexpr,
                   S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    """New streams [SP, BD] of token t at columns d: y[b] = post[b]*o + sum_a comb[a,b]*x[a], rounded where the
    torch path rounds (held in fp32)."""
    b = tl.arange(0, SP)
    b_ok = b < S
    row = t.to(tl.int64) * S * D
    post = tl.load(post_ptr + t * S + b, mask=b_ok, other=0.0).to(act).to(tl.float32)
    o = tl.load(o_ptr + t.to(tl.int64) * D + d, mask=d_ok, other=0.0).to(act).to(tl.float32)
    head = (post[:, None] * o[None, :]).to(act).to(tl.float32)
    mix = tl.zeros([SP, BD], dtype=tl.float32)
    for a in tl.static_range(S):
        h = tl.load(x_ptr + row + a * D + d, mask=d_ok, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + (t * S + a) * S + b, mask=b_ok, other=0.0).to(act).to(tl.float32)
        mix += c[:, None] * h[None, :]
    return (head + mix.to(act).to(tl.float32)).to(act).to(tl.float32)


@triton.jit
def _post_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, D,
                 S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    """Program (token, D tile): the new streams at its columns."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < D
    b = tl.arange(0, SP)
    y = _combined_tile(x_ptr, o_ptr, post_ptr, comb_ptr, t, d, d_ok, D, y_ptr.dtype.element_ty, S, SP, BD)
    tl.store(y_ptr + t.to(tl.int64) * S * D + b[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(b < S)[:, None] & d_ok[None, :])


@triton.jit
def _post_partial_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, dot_ptr, gram_ptr, T, D,
                         N: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr, GP: tl.constexpr,
                         BD: tl.constexpr):
    """Program (token, D tile): the new streams at its columns, and from them the next site's partials there
    (a D chunk of _pre_partial_kernel's, the tile being the chunk)."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    d = pid_d * BD + tl.arange(0, BD)
    d_ok = d < D
    b = tl.arange(0, SP)
    b_ok = b < S
    y = _combined_tile(x_ptr, o_ptr, post_ptr, comb_ptr, t, d, d_ok, D, y_ptr.dtype.element_ty, S, SP, BD)
    tl.store(y_ptr + t.to(tl.int64) * S * D + b[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=b_ok[:, None] & d_ok[None, :])
    y = tl.where(b_ok[:, None] & d_ok[None, :], y, 0.0)
    cols = tl.arange(0, NP)
    acc = tl.zeros([NP], dtype=tl.float32)
    for a in tl.static_range(S):
        y_a = tl.sum(tl.where(b[:, None] == a, y, 0.0), axis=0)
        w = tl.load(fn_ptr + cols[:, None] * (S * D) + a * D + d[None, :], mask=(cols < N)[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * y_a[None, :], axis=1)
    pair_ok = b_ok[:, None] & b_ok[None, :]
    gram = tl.where(b[None, :] >= b[:, None], tl.sum(y[:, None, :] * y[None, :, :], axis=2), 0.0)
    out = (pid_d * T + t).to(tl.int64)
    tl.store(dot_ptr + out * NP + cols, acc)
    tl.store(gram_ptr + out * GP + b[:, None] * S + b[None, :], gram, mask=pair_ok)


def _split(length: int, block: int, others: int) -> tuple[int, int]:
    """(pieces, chunk): cut `length` into block-aligned chunks so others * pieces is near the program target."""
    pieces = min(triton.next_power_of_2(triton.cdiv(_TARGET_PROGRAMS, max(others, 1))), triton.cdiv(length, block))
    chunk = triton.cdiv(triton.cdiv(length, pieces), block) * block
    return triton.cdiv(length, chunk), chunk


def _empty_partials(splits: int, t: int, s: int, device: torch.device) -> MhcPartials:
    _, np_, gp = _pads(s)
    return MhcPartials(torch.empty(splits, t, np_, dtype=torch.float32, device=device),
                       torch.empty(splits, t, gp, dtype=torch.float32, device=device))


def _reduce(x: torch.Tensor, fn: torch.Tensor) -> MhcPartials:
    """The site's partials read from the streams x [T, S, D] (contiguous)."""
    t, s, d = x.shape
    n, np_, gp = _pads(s)
    # The interpreter (CPU tensors) multiplies 16-bit floats' bit patterns in tl.dot, so it takes the fp32 path.
    native = x.is_cuda and x.dtype == fn.dtype and x.dtype in (torch.bfloat16, torch.float16)
    bt = DECODE_MAX_ROWS if t <= DECODE_MAX_ROWS else 64
    # An fp32 operand goes through FMA dots that hold whole K slices in registers: narrower K blocks there.
    bk = 64 if native and t > DECODE_MAX_ROWS else 32
    n_t = triton.cdiv(t, bt)
    splits, chunk = _split(d, bk, n_t)
    partials = _empty_partials(splits, t, s, x.device)
    _pre_partial_kernel[(n_t, splits)](x, fn, *partials, t, d, CHUNK=chunk, S=s, N=n, NP=np_, GP=gp, BT=bt, BK=bk,
                                        NATIVE_DOT=native, num_warps=4, num_stages=2 if t <= DECODE_MAX_ROWS else 3)
    return partials


@register("mhc_pre", "triton")
def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor,
            eps: float, hc_eps: float, sinkhorn_iters: int,
            partials: MhcPartials | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> (sublayer input, RMSNorm'd by `norm` [T, D], post [T, S] fp32, comb [T, S, S] fp32
    indexed [a, b]). `partials`: the site's, written by the mhc_post that made these streams (else reduced here)."""
    t, s, d = streams.shape
    x = streams.contiguous()
    if partials is None:
        partials = _reduce(x, fn.contiguous())
    splits = partials.dots.shape[0]
    _, np_, gp = _pads(s)
    assert partials.dots.shape[1:] == (t, np_) and partials.gram.shape == (splits, t, gp)
    u = torch.empty(t, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t, s, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, s, s, dtype=torch.float32, device=x.device)
    bd = 256
    d_splits, d_chunk = _split(d, bd, t)
    # One warp: the 4 x 4 Sinkhorn reductions stay in warp shuffles, no barriers on the serial chain.
    _pre_finish_kernel[(t, d_splits)](x, *partials, base, scale, norm, u, post, comb, t, d, splits, eps, hc_eps,
                                      d_chunk, ITERS=sinkhorn_iters, S=s, SP=triton.next_power_of_2(s),
                                      NP=np_, GP=gp, SPLITS_P=triton.next_power_of_2(splits),
                                      BD=bd, num_warps=1)
    return u, post, comb


@register("mhc_post", "triton")
def mhc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             next_fn: torch.Tensor | None = None) -> tuple[torch.Tensor, MhcPartials | None]:
    """H_new[:, b] = post[b] * out + sum_a comb[a, b] * H[:, a], in the activation dtype, and at decode sizes the
    partials of the site whose `fn` is `next_fn` (None: that site reduces them itself)."""
    t, s, d = streams.shape
    x, args = streams.contiguous(), (out.contiguous(), post.contiguous(), comb.contiguous())
    y = torch.empty_like(x)
    sp = triton.next_power_of_2(s)
    if next_fn is None or t > DECODE_MAX_ROWS:
        bd, warps = (256, 2) if t <= DECODE_MAX_ROWS else (1024, 4)
        _post_kernel[(t, triton.cdiv(d, bd))](x, *args, y, d, S=s, SP=sp, BD=bd, num_warps=warps)
        return y, None
    n, np_, gp = _pads(s)
    bd = 64  # 64 programs a token at D = 4,096, each reading its 24 x 4 x 64 of fn
    splits = triton.cdiv(d, bd)
    partials = _empty_partials(splits, t, s, x.device)
    _post_partial_kernel[(t, splits)](x, *args, y, next_fn.contiguous(), *partials, t, d, N=n, S=s, SP=sp, NP=np_,
                                      GP=gp, BD=bd, num_warps=2)
    return y, partials
