"""Triton RMSNorm and routing (run by Triton's interpreter on CPU) against the torch reference ops."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.norm import torch_ref as norm_ref
from engine.kernels.norm import triton_norm
from engine.kernels.router import torch_ref as router_ref
from engine.kernels.router import triton_router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 40)])
def test_rms_norm_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g)).to(dtype)
    got = triton_norm.rms_norm(x, w, 1e-5)
    want = norm_ref.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:  # the same casts in the same order: only the reduction's order differs
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    # bf16: each of the two roundings may land one ulp apart (the interpreter truncates where the GPU
    # rounds to nearest), so two ulps; a missing weight or a wrong statistic is far outside that.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)


def test_rms_norm_reads_strided_rows():
    """A stacked projection's output part is a view with a wider row stride."""
    wide = torch.randn(4, 100)
    part, w = wide[:, 20:84], torch.randn(64)
    assert not part.is_contiguous()
    torch.testing.assert_close(triton_norm.rms_norm(part, w, 1e-6), norm_ref.rms_norm(part, w, 1e-6),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("experts,k,tokens", [(288, 8, 3), (16, 4, 5), (20, 3, 1)])
def test_route_matches_reference(experts, k, tokens, normalize):
    g = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(tokens, experts, generator=g)
    bias = 0.5 * torch.randn(experts, generator=g)  # strong enough to change which experts win
    ids, weights = triton_router.route(logits, bias, k, normalize, 2.5)
    ref_ids, ref_weights = router_ref.route(logits, bias, k, normalize, 2.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, k)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)  # top-k sets, in any order
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-6)


def test_route_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[4.0, 0.0, -4.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])  # expert 2 is chosen for its bias, weighed by its own score
    ids, weights = triton_router.route(logits, bias, 2, False, 1.0)
    chosen = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert set(chosen) == {0, 2}
    assert chosen[2] == pytest.approx(float(torch.sigmoid(torch.tensor(-4.0))), rel=1e-6)
