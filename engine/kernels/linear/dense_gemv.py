"""Dense 16-bit weights at decode sizes (1..16 rows): a Triton GEMV where it beats cuBLAS, timed per shape.

At batch 1..16 a linear layer is a read of its weight, and cuBLAS's kernels for these shapes read a bf16
weight at ~45% of the H200's copy rate (the stacked KDA input projection, 105 MB: 55 us against 25; see
ops/BENCHMARKS.md). This kernel streams the weight in [BK, BN] tiles against one 16-row activation tile
(tl.dot's smallest M; padding rows cost no bytes), and splits K over programs until every SM has two, as
the FP8 decode kernel does, in one of three split widths (each width is a build: three compiles at most). Which of the two is faster depends on the shape and the GPU, so the first
eager call of each (rows, N, K, dtype, device) times both and keeps the faster (`event=dense_gemv`); a
call made while a CUDA graph is captured takes what was chosen, or cuBLAS for a shape never timed.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import triton
import triton.language as tl

log = logging.getLogger("glmflash.engine")

ROWS, BN, BK = 16, 64, 128
SPLIT_WIDTHS = (4096, 1024, 256)  # K columns per program, widest first (multiples of BK)
TIMED_RUNS = 5


@triton.jit(do_not_specialize=["M", "N", "K"])  # one build whatever the rows and sizes (strides keep theirs)
def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_split, stride_out,
                       K_SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (column tile, K split): out[split] [M, BN] tile = x @ w^T over K_SPLIT columns of K.

    The sizes are run-time values, not specialized on, and only the split's width is built in: three builds
    serve every projection and row count (compiled at start, kept in the Triton cache)."""
    rows = tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for step in range(0, K_SPLIT, BK):  # K_SPLIT is a multiple of BK
        ks = split * K_SPLIT + step + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter's tl.dot does not multiply 16-bit floats
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc += tl.dot(a, b)
    out = out_ptr + split.to(tl.int64) * stride_split + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, sms: int) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T -> [M, N] in x's dtype, K split to give `sms` SMs two programs each."""
    m, k = x.shape
    n = weight.shape[0]
    if m > ROWS or weight.shape[1] != k:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} against weight {tuple(weight.shape)} (at most {ROWS} rows)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = triton.cdiv(n, BN)
    k_split = next((w for w in SPLIT_WIDTHS if tiles * triton.cdiv(k, w) >= 2 * sms), SPLIT_WIDTHS[-1])
    split = triton.cdiv(k, k_split)
    out = torch.empty(split, m, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _dense_gemv_kernel[(tiles, split)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        K_SPLIT=k_split, DOT_F32=not x.is_cuda, BM=ROWS, BN=BN, BK=BK, num_warps=4, num_stages=4)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


Key = tuple[int, int, int, torch.dtype, torch.device]


class GemvChoices:
    """Per shape, whether the Triton GEMV runs instead of cuBLAS, decided by timing both once."""

    def __init__(self, timer: Callable[[Callable[[], object]], float]) -> None:
        """timer(fn) -> seconds of one call of fn (after fn has run once)."""
        self.timer = timer
        self.use_triton: dict[Key, bool] = {}
        self.seconds: dict[Key, tuple[float, float]] = {}  # (cuBLAS, Triton) per timed shape
        self.enabled = True  # False: cuBLAS everywhere (benchmarks compare the two)

    def decide(self, key: Key, cublas: Callable[[], object], triton_gemv: Callable[[], object],
               capturing: bool) -> bool:
        """The choice for `key`: kept, else timed now, unless a graph is being captured (then cuBLAS,
        not kept: a later eager call times it)."""
        chosen = self.use_triton.get(key)
        if chosen is not None:
            return chosen
        if capturing or not self.enabled:
            return False
        cublas_s = self.timer(cublas)
        try:
            triton_s = self.timer(triton_gemv)
        except Exception as error:  # e.g. a GPU the kernel does not build for: cuBLAS serves, loudly
            log.warning("event=dense_gemv_failed rows=%d n=%d k=%d error=%r", key[0], key[1], key[2], error)
            self.use_triton[key] = False
            return False
        chosen = self.use_triton[key] = triton_s < cublas_s
        self.seconds[key] = (cublas_s, triton_s)
        rows, n, k, dtype, _ = key
        log.info("event=dense_gemv rows=%d n=%d k=%d dtype=%s cublas_us=%.1f triton_us=%.1f chose=%s", rows, n, k,
                 str(dtype).removeprefix("torch."), cublas_s * 1e6, triton_s * 1e6,
                 "triton" if chosen else "cublas")
        return chosen


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median seconds of TIMED_RUNS calls of fn on the current stream, after one untimed call."""
    fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * TIMED_RUNS)]
    for start, end in zip(events[::2], events[1::2]):
        start.record()
        fn()
        end.record()
    events[-1].synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(events[::2], events[1::2]))
    return times[TIMED_RUNS // 2] / 1e3


CHOICES = GemvChoices(cuda_timer)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV applies: decode-sized 16-bit x [M, K] against a row-major weight of its dtype."""
    return (x.dim() == 2 and x.shape[0] <= ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dim() == 2 and weight.dtype == x.dtype and weight.stride(-1) == 1)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, sms: int) -> torch.Tensor:
    """x [M, K] @ weight^T on CUDA (`takes(x, weight)`): the Triton GEMV where it was timed faster."""
    key = (x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device)
    if CHOICES.decide(key, lambda: x @ weight.t(), lambda: dense_gemv(x, weight, sms),
                      torch.cuda.is_current_stream_capturing()):
        return dense_gemv(x, weight, sms)
    return x @ weight.t()
