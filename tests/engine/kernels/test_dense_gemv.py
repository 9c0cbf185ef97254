"""The dense decode GEMV (run by Triton's interpreter on CPU) against float64, and the per-shape choice
between it and cuBLAS."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.kernels.linear.dense_gemv import GemvChoices, dense_gemv, takes


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("m,n,k", [(1, 70, 256), (3, 130, 384), (2, 40, 1000), (16, 64, 200), (5, 600, 4200)])
def test_dense_gemv_matches_float64(m, n, k, dtype, tol):
    """K split over programs where the column tiles leave SMs idle (384 and 1,000 columns: 2 and 4 splits
    of 256, the last ragged), one wide split (600 rows: 10 tiles, K of 4,200 in two of 4,096), ragged N
    and K, 1 to 16 rows."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    want = x.double() @ weight.double().t()
    got = dense_gemv(x, weight, sms=4)
    assert got.dtype == dtype and got.shape == (m, n)
    assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_dense_gemv_reads_a_view_of_a_stacked_weight():
    """Rows of a stacked projection (the engine's q|k|v views): row stride K, an offset into the stack."""
    stacked = torch.randn(96, 128)
    x = torch.randn(2, 128)
    view = stacked[32:80]
    assert takes(x.bfloat16(), view.bfloat16())
    torch.testing.assert_close(dense_gemv(x, view, sms=4), x @ view.t(), rtol=1e-5, atol=1e-5)


def test_dense_gemv_takes_decode_sizes_only():
    x, w = torch.randn(17, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert not takes(x, w) and takes(x[:16], w)
    assert not takes(x[:4].float(), w.float())  # fp32 keeps cuBLAS
    assert not takes(x[:4], w.t().contiguous().t())  # column-major weight
    with pytest.raises(ValueError, match="at most 16 rows"):
        dense_gemv(x, w, sms=4)


def test_each_shape_is_timed_once_and_keeps_the_faster(caplog):
    seconds = {"cublas": 3e-5, "triton": 2e-5}
    calls = []

    def timer(fn):
        calls.append(fn())
        return seconds[calls[-1]]

    choices = GemvChoices(timer)
    key = (1, 12800, 4096, torch.bfloat16, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="glmflash.engine"):
        assert choices.decide(key, lambda: "cublas", lambda: "triton", capturing=False)
    assert calls == ["cublas", "triton"] and "chose=triton" in caplog.text and "n=12800 k=4096" in caplog.text
    assert choices.seconds[key] == (3e-5, 2e-5)
    assert choices.decide(key, lambda: "cublas", lambda: "triton", capturing=True)  # kept, not timed again
    assert len(calls) == 2
    seconds["triton"] = 9e-5
    other = (16, 12800, 4096, torch.bfloat16, torch.device("cpu"))
    assert not choices.decide(other, lambda: "cublas", lambda: "triton", capturing=True)  # never timed: cuBLAS
    assert other not in choices.use_triton and len(calls) == 2
    assert not choices.decide(other, lambda: "cublas", lambda: "triton", capturing=False)  # cuBLAS faster here
    assert choices.use_triton[other] is False
    choices.enabled = False
    third = (4, 12800, 4096, torch.bfloat16, torch.device("cpu"))
    assert not choices.decide(third, lambda: "cublas", lambda: "triton", capturing=False) and len(calls) == 4


def test_a_gemv_that_fails_to_run_leaves_cublas_and_says_so(caplog):
    def broken():
        raise RuntimeError("no build for this GPU")

    choices = GemvChoices(lambda fn: fn() or 1e-5)
    key = (8, 640, 4096, torch.bfloat16, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="glmflash.engine"):
        assert not choices.decide(key, lambda: None, broken, capturing=False)
    assert "event=dense_gemv_failed" in caplog.text and "no build for this GPU" in caplog.text
    assert choices.use_triton[key] is False
