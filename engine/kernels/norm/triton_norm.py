"""RMSNorm on CUDA: one program per row, the torch reference's casts (normalise in fp32, round to the
activation dtype, then the weight multiply rounded again), rows read through their stride so the views
a stacked projection returns need no copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.norm.torch_ref import rms_norm as torch_rms_norm


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@register("rms_norm", "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows may be strided) -> [..., D] in x's dtype, as the torch reference."""
    d = x.shape[-1]
    rows = x.reshape(-1, d) if x.dim() != 2 else x
    if x.dtype != weight.dtype or rows.stride(-1) != 1 or rows.shape[0] == 0:
        return torch_rms_norm(x, weight, eps)  # mixed dtypes promote in torch: keep its rules
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    bd = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, rows.stride(0), out.stride(0), eps, BD=bd,
                                       num_warps=4 if bd <= 4096 else 8)
    return out.view(x.shape)
