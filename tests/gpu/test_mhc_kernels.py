"""Triton mHC at the release sizes (S = 4, D = 4096) on CUDA against the torch reference ops."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.mhc import torch_ref, triton_kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

S, D, EPS, HC_EPS, ITERS = 4, 4096, 1e-5, 1e-6, 20
TOKENS = [1, 2, 16, 100, 2048]  # decode tile, ragged decode, full decode tile, ragged prefill tile, prefill


def site(t: int, dtype: torch.dtype, fn_dtype: torch.dtype, seed: int = 0):
    """Streams and one site's parameters on CUDA at the tiny model's magnitudes."""
    g = torch.Generator().manual_seed(seed)
    n, k = (2 + S) * S, S * D
    streams = torch.randn(t, S, D, generator=g).to(dtype)
    fn = (2.0 * torch.randn(n, k, generator=g) / k ** 0.5).to(fn_dtype)
    base = torch.randn(n, generator=g)
    scale = 0.5 + torch.rand(3, generator=g)
    return [x.cuda() for x in (streams, fn, base, scale)]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("dtype,fn_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32)])
def test_pre_matches_reference(t, dtype, fn_dtype):
    args = site(t, dtype, fn_dtype, seed=t)
    u, post, comb = triton_kernels.mhc_pre(*args, EPS, HC_EPS, ITERS)
    # The reference runs on the CPU: true fp32 products whatever the CUDA matmul precision flags say.
    ref_u, ref_post, ref_comb = torch_ref.mhc_pre(*(x.cpu() for x in args), EPS, HC_EPS, ITERS)
    assert u.dtype == dtype and post.dtype == comb.dtype == torch.float32
    for got in (u, post, comb):
        assert torch.isfinite(got).all()
    assert rel(post, ref_post) < 1e-4
    assert rel(comb, ref_comb) < 1e-4
    assert rel(u, ref_u) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_matches_reference(t, dtype):
    streams, fn, base, scale = site(t, dtype, dtype, seed=t + 1)
    _, post, comb = torch_ref.mhc_pre(streams, fn, base, scale, EPS, HC_EPS, ITERS)
    out = torch.randn(t, D, generator=torch.Generator().manual_seed(t)).to(dtype).cuda()
    got = triton_kernels.mhc_post(streams, out, post, comb)
    assert got.dtype == dtype and got.shape == streams.shape and torch.isfinite(got).all()
    if dtype == torch.bfloat16:
        # Same roundings as the torch path (coefficients, product, mix, sum), so only summation order differs;
        # skipping the coefficient rounding alone would be 3e-3 off.
        # The GPU fuses products into FMAs where torch rounds each one: bf16-ulp level (2^-8) differences.
        assert rel(got, torch_ref.mhc_post(streams, out, post, comb)) < 5e-3
    else:
        assert rel(got, torch_ref.mhc_post(streams.double(), out.double(), post, comb)) < 1e-5


def test_graph_replay_equals_eager():
    """One decode site (T = 1) captured in a CUDA graph, replayed on new inputs."""
    streams, fn, base, scale = site(1, torch.bfloat16, torch.bfloat16)
    out = torch.randn(1, D, device="cuda").to(torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        u, post, comb = triton_kernels.mhc_pre(streams, fn, base, scale, EPS, HC_EPS, ITERS)
        return u, post, comb, triton_kernels.mhc_post(streams, out, post, comb)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    streams.copy_(torch.randn_like(streams))
    out.copy_(torch.randn_like(out))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
