"""Clamped SwiGLU on CUDA: one program per row block, the torch reference's roundings (silu rounded to the
activation dtype, then the product rounded again); gate and up read through their strides, so the two halves
of a stacked gate/up projection need no copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.swiglu.torch_ref import clamped_swiglu as torch_clamped_swiglu


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_o, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.minimum(tl.load(gate_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32), limit)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    u = tl.minimum(tl.maximum(tl.load(up_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32), -limit),
                   limit)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=ok)


@register("clamped_swiglu", "triton")
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [T, N] (rows may be strided) -> [T, N] in their dtype, as the torch reference."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.stride(-1) != 1 or \
            up.stride(-1) != 1 or gate.shape[0] == 0:
        return torch_clamped_swiglu(gate, up, limit)
    rows, n = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _swiglu_kernel[(rows, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                                  float(limit), BLOCK=block, num_warps=4)
    return out
