"""KDA prefill for CUDA: fla-core's chunked KDA over the whole flat ragged batch in one set of launches.

`chunk_kda` with `cu_seqlens` (varlen: tensors [1, N, H, d], one initial/final state per sequence)
does the reference's math: g is taken as the natural-log decay we already computed (it cumsums it
per chunk and rescales by 1/ln 2 for exp2 itself), q and k come L2-normalised as fla's
`use_qk_l2norm_in_kernel` would (x / sqrt(sum x^2 + 1e-6), the same eps inside the root as the
reference; `l2_normalized` says why not fla's), and q is scaled by d^-0.5 after it. What differs is
rounding: fla stores the normalised q/k, the WY factors and the per-chunk states in the input dtype (bf16
when serving) where the reference keeps fp32, and its fp32-input matmuls may run in TF32. The exact-fp32
intra-chunk path is used (`safe_gate` off), so any g is valid, not only gates bounded below by -5.

Not for CUDA graphs: fla sizes its chunk list from cu_seqlens with a host sync (repeat_interleave)
and memoises the list by cu_seqlens tensor identity, so pass a fresh cu_seqlens per batch, never a
buffer refilled in place.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, wait
from typing import Callable

import torch
import triton
import triton.language as tl

from engine.kernels.background import OncePerKey
from engine.kernels.cache_keys import settle_kernel_keys
from engine.kernels.dispatch import register
from engine.kernels.kda.fla_tuning import use_tuned_configs

_warm_ups = OncePerKey("kda-warm-up")  # by (device, heads, dim, dtype)


@register("kda_prefill", "triton")
def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                rec_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Same contract as the torch reference `kda_prefill`."""
    chunk_kda = _fla_chunk_kda(torch.cuda.get_device_capability(q.device))
    assert rec_state.dtype == torch.float32
    q, k = l2_normalized(q), l2_normalized(k)
    out, final = chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                           initial_state=rec_state[slots], output_final_state=True, cu_seqlens=cu_seqlens)
    rec_state[slots] = final
    return out[0]


@functools.cache
def _fla_chunk_kda(capability: tuple[int, int]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """fla's chunked KDA, imported at first use (importing fla.ops loads every fla op: seconds), after its
    tuned configs are offered (fla reads the mode at import) and with kernel keys that do not depend on
    the call order."""
    use_tuned_configs(capability)
    settle_kernel_keys()
    from fla.ops.kda import chunk_kda

    return chunk_kda


@triton.jit
def _l2_normalized_kernel(x_ptr, out_ptr, stride_t, stride_h, eps, H: tl.constexpr, D: tl.constexpr,
                          BH: tl.constexpr):
    """Program (token): each head's row of D over its own L2 norm in fp32, stored contiguous in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BH)[:, None]
    cols = tl.arange(0, D)[None, :]
    ok = heads < H
    x = tl.load(x_ptr + t * stride_t + heads * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    tl.store(out_ptr + (t * H + heads) * D + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [N, H, d] (rows through their strides) / sqrt(sum x^2 + eps) over the head dim in fp32, stored contiguous
    in x's dtype: what fla's in-kernel q/k norm computes. Ours because fla's autotunes per bucket of rows (tokens x
    heads / 65,536, a constexpr): each new prefill size class would tune 25 configs in a request. One launch
    reading x once (the torch form took five fp32 passes: ~4 ms a KDA layer at a 32,768-token prompt, est.)."""
    n, h, d = x.shape
    assert d & (d - 1) == 0 and x.stride(-1) == 1, "a power-of-two head dim, unit column stride"
    out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
    if n:
        _l2_normalized_kernel[(n,)](x, out, x.stride(0), x.stride(1), eps, H=h, D=d, BH=triton.next_power_of_2(h),
                                    num_warps=4)
    return out


def warm_up_kda_prefill(device: torch.device | str, heads: int, dim: int, dtype: torch.dtype) -> None:
    """Run fla's autotuners now (seconds per kernel) so the first request does not wait for them.

    The autotune keys never include the token count or the number of sequences: chunk_local_cumsum (H,
    S=d, BT, IS_VARLEN), the token-parallel intra kernel (K, H, HV), inter_solve_fused (H, HV, K, BT, BC,
    NC), recompute_w_u (H, HV, K, V, BT, BK, BV, IS_VARLEN), fwd_h (H, HV, K, V, BT, STATE_V_FIRST) and
    fwd_o (BT, HV, K, V, STATE_V_FIRST); Triton adds the dtype of every tensor argument. So one small
    ragged batch per (heads, dim, dtype) tunes every prefill. Results also
    persist in Triton's cache directory (fla sets cache_results), so a restart skips the search; where
    configs are shipped for the GPU (fla_tuning) there is no search, one compile per kernel.
    """
    lengths = torch.tensor([0, 1, 64, 65], device=device)  # a lone token, a full chunk, a chunk and one
    n = int(lengths.sum())
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    g = -torch.rand(n, heads, dim, device=device, generator=gen)
    beta = torch.rand(n, heads, device=device, dtype=dtype, generator=gen)
    state = torch.zeros(len(lengths) - 1, heads, dim, dim, device=device)
    kda_prefill(q, k, v, g, beta, state, torch.arange(len(lengths) - 1, device=device), lengths.cumsum(0))


def start_kda_warm_up(device: torch.device | str, heads: int, dim: int, dtype: torch.dtype,
                      after: Future | None = None) -> Future:
    """`warm_up_kda_prefill` on a thread of its own, once per process and shapes -> its future; after
    `after` is done (a preload that compiles the same kernels), whatever its outcome.

    It needs only the shapes, so a loader starts it as soon as the config is known: the autotuning then
    runs while the weights are read (the disk bounds a cold start, the GPU is idle meanwhile), and the
    engine waits on the same future instead of tuning after the load."""
    key = (str(torch.device(device)), heads, dim, dtype)

    def run() -> None:
        if after is not None:
            wait([after])
        warm_up_kda_prefill(device, heads, dim, dtype)

    return _warm_ups.start(key, run)
