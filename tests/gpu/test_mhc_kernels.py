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
    """Streams and one site's parameters (its sublayer's norm weight last) on CUDA at the tiny model's magnitudes."""
    g = torch.Generator().manual_seed(seed)
    n, k = (2 + S) * S, S * D
    streams = torch.randn(t, S, D, generator=g).to(dtype)
    fn = (2.0 * torch.randn(n, k, generator=g) / k ** 0.5).to(fn_dtype)
    base = torch.randn(n, generator=g)
    scale = 0.5 + torch.rand(3, generator=g)
    norm = (0.5 + torch.rand(D, generator=g)).to(dtype)
    return [x.cuda() for x in (streams, fn, base, scale, norm)]


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
    # The normed collapse: the norm's statistic comes from the Gram matrix (the unrounded collapse), the
    # reference's from the rounded one; each output's three bf16 roundings match the reference's.
    assert rel(u, ref_u) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_matches_reference(t, dtype):
    streams, fn, base, scale, norm = site(t, dtype, dtype, seed=t + 1)
    _, post, comb = torch_ref.mhc_pre(streams, fn, base, scale, norm, EPS, HC_EPS, ITERS)
    out = torch.randn(t, D, generator=torch.Generator().manual_seed(t)).to(dtype).cuda()
    got, partials = triton_kernels.mhc_post(streams, out, post, comb)
    assert partials is None
    assert got.dtype == dtype and got.shape == streams.shape and torch.isfinite(got).all()
    if dtype == torch.bfloat16:
        # Same roundings as the torch path (coefficients, product, mix, sum), so only summation order differs;
        # skipping the coefficient rounding alone would be 3e-3 off.
        # The GPU fuses products into FMAs where torch rounds each one: bf16-ulp level (2^-8) differences.
        assert rel(got, torch_ref.mhc_post(streams, out, post, comb)[0]) < 5e-3
    else:
        assert rel(got, torch_ref.mhc_post(streams.double(), out.double(), post, comb)[0]) < 1e-5


@pytest.mark.parametrize("t", [1, 2, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_combine_hands_the_next_mix_its_partials(t, dtype):
    """At decode sizes the combine reduces for the next site as it writes the streams: that site's mix from the
    partials equals its mix reduced from the streams (summation order aside) and the reference."""
    streams, fn, base, scale, norm = site(t, dtype, dtype, seed=t + 2)
    _, post, comb = torch_ref.mhc_pre(streams, fn, base, scale, norm, EPS, HC_EPS, ITERS)
    out = torch.randn(t, D, generator=torch.Generator().manual_seed(t)).to(dtype).cuda()
    _, next_fn, next_base, next_scale, next_norm = site(t, dtype, dtype, seed=t + 3)
    mixed, partials = triton_kernels.mhc_post(streams, out, post, comb, next_fn)
    assert partials is not None and torch.equal(mixed, triton_kernels.mhc_post(streams, out, post, comb)[0])
    handed = triton_kernels.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS, HC_EPS, ITERS, partials)
    reduced = triton_kernels.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS, HC_EPS, ITERS)
    assert rel(handed[1], reduced[1]) < 1e-5 and rel(handed[2], reduced[2]) < 1e-5
    assert rel(handed[0], reduced[0]) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
    ref = torch_ref.mhc_pre(*(x.cpu() for x in (mixed, next_fn, next_base, next_scale, next_norm)), EPS, HC_EPS,
                            ITERS)
    assert rel(handed[1], ref[1]) < 1e-4 and rel(handed[2], ref[2]) < 1e-4
    assert rel(handed[0], ref[0]) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_graph_replay_equals_eager():
    """Two decode sites (T = 1) captured in a CUDA graph, replayed on new inputs: the first's mix reduces from the
    streams, the second's from the partials the first's combine handed on."""
    streams, fn, base, scale, norm = site(1, torch.bfloat16, torch.bfloat16)
    _, next_fn, next_base, next_scale, next_norm = site(1, torch.bfloat16, torch.bfloat16, seed=1)
    out = torch.randn(1, D, device="cuda").to(torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        u, post, comb = triton_kernels.mhc_pre(streams, fn, base, scale, norm, EPS, HC_EPS, ITERS)
        mixed, partials = triton_kernels.mhc_post(streams, out, post, comb, next_fn)
        return u, post, comb, mixed, *triton_kernels.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS,
                                                             HC_EPS, ITERS, partials)

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
