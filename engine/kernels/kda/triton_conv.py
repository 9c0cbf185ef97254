"""The chunked KDA path's ragged short conv on CUDA: one launch reads each token's window from the conv buffer.

The portable `short_conv_varlen` runs torch's depthwise conv1d over the buffer transposed to [C, rows] in fp32,
then SiLU, a cast and a gather of the token windows: at a 32,768-token prompt ~15 ms of device time a KDA layer in
the conv alone (an H100 profile), ~7% of the whole model's prefill at that length over its 34 KDA layers.
Here program (token block, channel block) loads the k rows of each token's window straight from the row-major
buffer (neighbouring tokens share rows in L2), sums them against the fp32 weights and applies SiLU: bound by
reading the buffer once and writing the output. fla's causal_conv1d does the same arithmetic but keeps a k-wide
state per sequence and autotunes at its first call, where our buffer already holds the k-1 held inputs and a start
must not tune in its serving path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.kda.torch_ref import ConvRows, conv_buffer

BLOCK_T = 16  # tokens a program
BLOCK_C = 256  # channels a program


@triton.jit(do_not_specialize=["N", "C"], do_not_specialize_on_alignment=["windows_ptr"])
def _conv_silu_kernel(seq_ptr, w_ptr, windows_ptr, y_ptr, N, C, K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """y[n, c] = SiLU(sum_j w[c, j] * seq[windows[n] + j, c]) in fp32, stored in y's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < N
    ch_ok = ch < C
    start = tl.load(windows_ptr + rows, mask=row_ok, other=0)
    mask = row_ok[:, None] & ch_ok[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + ch * K + j, mask=ch_ok, other=0.0)
        x = tl.load(seq_ptr + (start + j)[:, None] * C + ch[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32) * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + ch[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@register("short_conv_varlen", "triton")
def short_conv_varlen(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      rows: ConvRows) -> tuple[torch.Tensor, torch.Tensor]:
    """As the torch reference (engine.kernels.kda.torch_ref.short_conv_varlen)."""
    seq = conv_buffer(x, state, rows)
    n, c = x.shape
    y = torch.empty(n, c, dtype=x.dtype, device=x.device)
    if n:
        _conv_silu_kernel[(triton.cdiv(n, BLOCK_T), triton.cdiv(c, BLOCK_C))](
            seq, weight.contiguous(), rows.windows, y, n, c, K=weight.shape[-1], BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
            num_warps=4)
    return y, seq[rows.last].transpose(1, 2)
