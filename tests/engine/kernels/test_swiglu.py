"""The clamped SwiGLU: the Triton kernel (in the interpreter here) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.swiglu.torch_ref import clamped_swiglu as torch_swiglu
from engine.kernels.swiglu.triton_swiglu import clamped_swiglu as triton_swiglu
from tests.engine.kernels.sm90 import assert_compiles_for_sm90


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_matches_the_reference_through_strided_halves(dtype):
    """gate and up as the two halves of one stacked projection's output (rows strided); a spread of 3x the
    limit saturates both clamps. The interpreter truncates where the GPU rounds to nearest: two steps of bf16
    (silu, then the product) at most; fp32: a few ulps of exp."""
    g = torch.Generator().manual_seed(2)
    both = (6 * torch.randn(5, 2 * 1300, generator=g)).to(dtype)
    gate, up = both.split(1300, dim=-1)
    limit = 7.0
    assert (gate > limit).float().mean() > 0.1 and (up.abs() > limit).float().mean() > 0.2
    want, got = torch_swiglu(gate, up, limit), triton_swiglu(gate, up, limit)
    assert got.dtype == dtype and got.shape == want.shape
    ulp = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-20
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-30).all()
    exact = torch.nn.functional.silu(gate.double().clamp(max=limit)) * up.double().clamp(-limit, limit)
    assert (want.double() - exact).abs().max() <= 2 * ulp * exact.abs().max()


def test_the_kernel_compiles_for_sm90(tmp_path):
    assert_compiles_for_sm90("""
from engine.kernels.swiglu.triton_swiglu import _swiglu_kernel
compile_for_sm90(_swiglu_kernel, dict(gate_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024), 4,
                 dict(limit="fp32"))
print("compiled")
""", tmp_path)
