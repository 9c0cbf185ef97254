"""KDA's forget gate for a prefill on CUDA: one launch from the 16-bit up-projection to the fp32 log-decay.

The portable `forget_gate` takes five torch passes (the cast, the bias, the rate, the sigmoid, the bound), each
reading and writing [N, H*d] in fp32: ~34 bytes an element where this kernel reads 2 and writes 4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register

BLOCK = 1024  # elements a program


@triton.jit(do_not_specialize=["total"])
def _forget_gate_kernel(f_ptr, bias_ptr, rate_ptr, out_ptr, total, stride_f, lower_bound, P: tl.constexpr,
                        D: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, c] = lower_bound * sigmoid(rate[c // D] * (f[t, c] + bias[c])) in fp32, c over the P gate columns."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = at < total
    row, col = at // P, at % P
    f = tl.load(f_ptr + row * stride_f + col, mask=ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    rate = tl.load(rate_ptr + col // D, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, lower_bound * tl.sigmoid(rate * (f + bias)), mask=ok)


@register("forget_gate", "triton")
def forget_gate(f: torch.Tensor, dt_bias: torch.Tensor, decay_rate: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """As the torch reference (engine.kernels.kda.torch_ref.forget_gate): f [T, H*d] -> [T, H, d] fp32."""
    t, p = f.shape
    h = decay_rate.shape[0]
    if f.stride(-1) != 1:
        f = f.contiguous()
    out = torch.empty(t, h, p // h, dtype=torch.float32, device=f.device)
    if t:
        _forget_gate_kernel[(triton.cdiv(t * p, BLOCK),)](f, dt_bias.contiguous(), decay_rate.contiguous(), out,
                                                          t * p, f.stride(0), lower_bound, P=p, D=p // h,
                                                          BLOCK=BLOCK, num_warps=4)
    return out
