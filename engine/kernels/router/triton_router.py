"""MoE routing on CUDA: one program per token does the sigmoid, the biased top-k (k passes of argmax
over the expert row held in registers), the gather, the normalisation and the scaling, replacing a
chain of seven launches per MoE layer at decode. At decode the fp32 logits come from one GEMV that reads the
16-bit activations as they are (where a cast launch, then an fp32 matmul, ran)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.router.torch_ref import router_logits as torch_router_logits

DECODE_MAX_ROWS = 16  # up to this many tokens the logits take the GEMV; a prefill's matmul is math-bound


@triton.jit(do_not_specialize=["T"])
def _logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, stride_x, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """Program (block of BE experts): logits [T, BE] = x [T, D] @ w[BE, D]^T, products and sums in fp32."""
    experts = tl.program_id(0) * BE + tl.arange(0, BE)
    e_ok = experts < E
    rows = tl.arange(0, BT)
    r_ok = rows < T
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    k0 = D * 0
    while k0 < D:  # a runtime bound: a while loop (the interpreter takes no runtime range)
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < D
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * D + ks[None, :], mask=e_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        k0 += BK
    tl.store(out_ptr + rows[:, None] * E + experts[None, :], acc, mask=r_ok[:, None] & e_ok[None, :])


@register("router_logits", "triton")
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As the torch reference; up to DECODE_MAX_ROWS tokens in one GEMV launch, 16-bit x read as it is."""
    t, d = x.shape
    e = weight.shape[0]
    if t > DECODE_MAX_ROWS or t == 0 or x.stride(-1) != 1 or not weight.is_contiguous():
        return torch_router_logits(x, weight)
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    be = 4  # 72 programs at 288 experts: the 4.7 MB fp32 weight read by most SMs
    _logits_kernel[(triton.cdiv(e, be),)](x, weight, out, t, e, d, x.stride(0), BT=DECODE_MAX_ROWS, BE=be, BK=128,
                                          num_warps=4)
    return out


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, stride_l, scaling,
                  K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, NORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BE)
    ok = experts < E
    scores = tl.sigmoid(tl.load(logits_ptr + row * stride_l + experts, mask=ok, other=0.0))
    chosen = tl.where(ok, scores + tl.load(bias_ptr + experts, mask=ok, other=0.0), float("-inf"))
    slots = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    weights = tl.zeros([KP], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.argmax(chosen, axis=0)  # the lowest index among equal maxima
        ids = tl.where(slots == k, best, ids)
        weights = tl.where(slots == k, tl.sum(tl.where(experts == best, scores, 0.0), axis=0), weights)
        chosen = tl.where(experts == best, float("-inf"), chosen)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + row * K + slots, ids, mask=slots < K)
    tl.store(weights_ptr + row * K + slots, weights * scaling, mask=slots < K)


@register("route", "triton")
def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, normalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (expert ids [T, k] int64, weights [T, k] fp32), as the torch reference."""
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, bias, ids, weights, e, logits.stride(0), scaling, K=top_k,
                            KP=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(e), NORMALIZE=normalize,
                            num_warps=4)
    return ids, weights
