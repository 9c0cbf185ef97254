"""Triton mHC (run by Triton's interpreter on CPU) against the torch reference ops.

mhc_pre's reference computes in fp32 whatever its inputs, so it is the oracle as is: the mixing weights
must agree to 1e-5, the normed collapse to fp32 accuracy (bf16's where the activations are bf16). mhc_post is
checked against float64; the partials it hands the next site must give that site's mhc_pre what reducing the
new streams gives.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.mhc import torch_ref, triton_kernels
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

EPS, HC_EPS, ITERS = 1e-5, 1e-6, 20
# (T, D): decode-sized token tiles at both widths; 33 tokens take the prefill tiling with a ragged last tile.
# D = 96 is not a multiple of the 64/256-wide blocks. The interpreter is slow, so 33 runs at one width.
SHAPES = [(1, 64), (1, 96), (5, 64), (5, 96), (33, 96)]


def site(t: int, d: int, s: int = 4, dtype: torch.dtype = torch.float32, fn_dtype: torch.dtype | None = None,
         comb_scale: float = 1.0, seed: int = 0):
    """Streams and one site's parameters at the tiny model's magnitudes (fn strong enough to mix unevenly; a
    norm weight far from ones, so a collapse left un-normed or normed by the wrong statistic shows)."""
    g = torch.Generator().manual_seed(seed)
    n, k = (2 + s) * s, s * d
    streams = torch.randn(t, s, d, generator=g).to(dtype)
    fn = (2.0 * torch.randn(n, k, generator=g) / k ** 0.5).to(fn_dtype or dtype)
    base = torch.randn(n, generator=g)
    scale = (0.5 + torch.rand(3, generator=g)) * torch.tensor([1.0, 1.0, comb_scale])
    norm = (0.5 + torch.rand(d, generator=g)).to(dtype)
    return streams, fn, base, scale, norm


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def assert_pre_close(got, want) -> None:
    """Mixing weights are fp32 sums of exact products in any dtype; the normed collapse is loose only in bf16, where
    the interpreter truncates each of its three roundings (collapse, norm, weight multiply) and so biases it
    (a missing or wrong norm is off by tens of percent)."""
    (u, post, comb), (ref_u, ref_post, ref_comb) = got, want
    assert post.dtype == comb.dtype == torch.float32 and u.dtype == ref_u.dtype
    assert post.shape == ref_post.shape and comb.shape == ref_comb.shape and u.shape == ref_u.shape
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-7)
    assert rel(u, ref_u) < (2.5e-2 if u.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", SHAPES)
def test_pre(t, d, dtype):
    args = site(t, d, dtype=dtype, seed=t * d)
    assert_pre_close(triton_kernels.mhc_pre(*args, EPS, HC_EPS, ITERS),
                     torch_ref.mhc_pre(*args, EPS, HC_EPS, ITERS))


def test_pre_fp32_streams_bf16_fn():
    args = site(5, 96, fn_dtype=torch.bfloat16)
    assert_pre_close(triton_kernels.mhc_pre(*args, EPS, HC_EPS, ITERS),
                     torch_ref.mhc_pre(*args, EPS, HC_EPS, ITERS))


def test_pre_pads_stream_count():
    """S = 3 pads every stream axis to 4 and the 15 mixes to 16: padding must not leak into softmax or Sinkhorn."""
    args = site(5, 64, s=3)
    assert_pre_close(triton_kernels.mhc_pre(*args, EPS, HC_EPS, ITERS),
                     torch_ref.mhc_pre(*args, EPS, HC_EPS, ITERS))


def test_pre_eps_placement():
    """Large epsilons make every eps term (norm, pre gate, softmax, each Sinkhorn denominator) visible."""
    args = site(5, 64, seed=2)
    assert_pre_close(triton_kernels.mhc_pre(*args, 0.5, 0.05, ITERS),
                     torch_ref.mhc_pre(*args, 0.5, 0.05, ITERS))


def test_sinkhorn_runs_every_iteration():
    """A peaked comb still moves at the last iteration, so one pass short would be far off the reference."""
    args = site(5, 64, comb_scale=4.0, seed=1)
    comb = triton_kernels.mhc_pre(*args, EPS, HC_EPS, ITERS)[2]
    full = torch_ref.mhc_pre(*args, EPS, HC_EPS, ITERS)[2]
    short = torch_ref.mhc_pre(*args, EPS, HC_EPS, ITERS - 1)[2]
    assert (full - short).abs().max() > 1e-4
    assert (comb - full).abs().max() < 1e-2 * (comb - short).abs().max()


def post_inputs(t: int, d: int, dtype: torch.dtype, seed: int):
    streams, fn, base, scale, norm = site(t, d, dtype=dtype, seed=seed)
    _, post, comb = torch_ref.mhc_pre(streams, fn, base, scale, norm, EPS, HC_EPS, ITERS)
    out = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return streams, out, post, comb


@pytest.mark.parametrize("t,d", SHAPES)
def test_post_fp32(t, d):
    streams, out, post, comb = post_inputs(t, d, torch.float32, seed=t + d)
    got, partials = triton_kernels.mhc_post(streams, out, post, comb)
    want, _ = torch_ref.mhc_post(streams.double(), out.double(), post, comb)
    assert partials is None
    assert got.dtype == torch.float32 and got.shape == streams.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,d", SHAPES)
def test_post_bf16(t, d):
    streams, out, post, comb = post_inputs(t, d, torch.bfloat16, seed=t + d)
    got, _ = triton_kernels.mhc_post(streams, out, post, comb)
    # The exact value of the bf16 computation: coefficients rounded to bf16 as the reference does, then float64.
    exact, _ = torch_ref.mhc_post(streams.double(), out.double(), post.bfloat16().double(), comb.bfloat16().double())
    assert got.dtype == torch.bfloat16 and got.shape == streams.shape
    assert rel(got, exact) < 1e-2
    assert rel(got, torch_ref.mhc_post(streams, out, post, comb)[0]) < 1.5e-2  # the interpreter truncates to bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d,s", [(1, 96, 4), (5, 64, 4), (3, 64, 3)])
def test_post_hands_the_next_site_its_partials(t, d, s, dtype):
    """At decode sizes the combine reduces the new streams for the next site as it writes them: that site's mix from
    those partials equals its mix reduced from the streams, and both equal the reference."""
    streams, fn, base, scale, norm = site(t, d, s=s, dtype=dtype, seed=7 * t + d)
    _, post, comb = torch_ref.mhc_pre(streams, fn, base, scale, norm, EPS, HC_EPS, ITERS)
    out = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(dtype)
    _, next_fn, next_base, next_scale, next_norm = site(t, d, s=s, dtype=dtype, seed=7 * t + d + 1)
    mixed, partials = triton_kernels.mhc_post(streams, out, post, comb, next_fn)
    alone, none = triton_kernels.mhc_post(streams, out, post, comb)
    assert none is None and partials is not None and torch.equal(mixed, alone)
    handed = triton_kernels.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS, HC_EPS, ITERS, partials)
    reduced = triton_kernels.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS, HC_EPS, ITERS)
    for got, want in zip(handed, reduced):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_pre_close(handed, torch_ref.mhc_pre(mixed, next_fn, next_base, next_scale, next_norm, EPS, HC_EPS, ITERS))


def test_prefill_sized_combines_hand_no_partials():
    """Past 16 tokens the next site reduces with its token-tiled kernel (fn read once a tile, not once a token)."""
    streams, out, post, comb = post_inputs(17, 64, torch.float32, seed=3)
    _, partials = triton_kernels.mhc_post(streams, out, post, comb, site(17, 64)[1])
    assert partials is None


def test_the_kernels_compile_for_sm90(tmp_path):
    """Every build the release's decode and prefill take compiles for the GPU (bf16 streams and fn, S = 4): the
    interpreter takes code the compiler would reject (a static loop from a static loop's index, 3-D reductions)."""
    assert_compiles_for_sm90("""
from engine.kernels.mhc.triton_kernels import _post_kernel, _post_partial_kernel, _pre_finish_kernel, _pre_partial_kernel
for bt, bk, native, chunk in ((16, 32, True, 32), (64, 64, True, 128), (16, 32, False, 32)):
    compile_for_sm90(_pre_partial_kernel, dict(x_ptr="*bf16", fn_ptr="*bf16", dot_ptr="*fp32", gram_ptr="*fp32"),
                     dict(CHUNK=chunk, S=4, N=24, NP=32, GP=16, BT=bt, BK=bk, NATIVE_DOT=native), 4)
compile_for_sm90(_pre_finish_kernel, dict(x_ptr="*bf16", dot_ptr="*fp32", gram_ptr="*fp32", base_ptr="*fp32",
                 scale_ptr="*fp32", norm_ptr="*bf16", u_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32"),
                 dict(ITERS=20, S=4, SP=4, NP=32, GP=16, SPLITS_P=128, BD=256), 1, dict(eps="fp32", hc_eps="fp32"))
compile_for_sm90(_post_partial_kernel, dict(x_ptr="*bf16", o_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32",
                 y_ptr="*bf16", fn_ptr="*bf16", dot_ptr="*fp32", gram_ptr="*fp32"),
                 dict(N=24, S=4, SP=4, NP=32, GP=16, BD=64), 2)
compile_for_sm90(_post_kernel, dict(x_ptr="*bf16", o_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", y_ptr="*bf16"),
                 dict(S=4, SP=4, BD=1024), 4)
print("compiled")
""", tmp_path)
