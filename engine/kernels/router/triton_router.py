"""MoE routing on CUDA: one program per token does the sigmoid, the biased top-k (k passes of argmax
over the expert row held in registers), the gather, the normalisation and the scaling, replacing a
chain of seven launches per MoE layer at decode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register


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
