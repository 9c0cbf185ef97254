"""Stacked projections: one matmul over weights stacked along N equals the separate linears, per format."""

from __future__ import annotations

import pytest
import torch

from engine.quant import FP8_BLOCK, quantize_fp8_block, quantize_nvfp4
from engine.model.layers import FusedLinear, linear
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight, Weight

K = 256


def make(fmt: str, n: int, seed: int) -> Weight:
    w = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5
    if fmt == "dense":
        return DenseWeight(w)
    if fmt == "fp8":
        return Fp8BlockWeight(*quantize_fp8_block(w, FP8_BLOCK))
    packed, scale, global_scale = quantize_nvfp4(w)
    return Nvfp4Weight(packed, scale, global_scale * (1.0 + seed / 10))  # distinct per-part global scales


@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_stacked_matches_separate_and_rebinds_views(fmt):
    rows = {"q": 256, "k": 128, "low": 128, "beta": 32}  # FP8: only the last part ends inside a block
    w = {name: make(fmt, n, i) for i, (name, n) in enumerate(rows.items())}
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(9))
    want = [torch.cat([linear(x, w["q"]), linear(x, w["k"])], -1), linear(x, w["low"]), linear(x, w["beta"])]
    dequantized = {name: weight.dequantize(torch.float32) for name, weight in w.items()}
    fused = FusedLinear(w, ("q", "k"), "low", "beta")
    assert fused.stacked is not None
    for got, ref in zip(fused(x), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, weight in w.items():  # the dict now holds views of the stack with the same values
        assert weight.shape == (rows[name], K)
        torch.testing.assert_close(weight.dequantize(torch.float32), dequantized[name], rtol=0, atol=0)


def test_unstackable_parts_run_one_by_one():
    w = {"a": make("fp8", 100, 1), "b": make("fp8", 128, 2), "c": make("dense", 64, 3)}
    x = torch.randn(2, K)
    want = [torch.cat([linear(x, w["a"]), linear(x, w["b"])], -1), linear(x, w["c"])]
    fused = FusedLinear(dict(w), ("a", "b"), "c")  # FP8 rows end inside a block; formats differ too
    assert fused.stacked is None
    for got, ref in zip(fused(x), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert FusedLinear({"a": make("fp8", 100, 1), "b": make("fp8", 128, 2)}, "a", "b").stacked is None
