"""The dense decode GEMV on CUDA at the release's projection shapes, against cuBLAS; the per-shape choice
inside a captured graph (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.dispatch import kernel
from engine.kernels.linear import dense_gemv
from engine.kernels.linear.triton_linear import sm_count
from engine.weights import DenseWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

# (N, K) of dense decode projections at the release's widths: KDA q|k|v + gates, o_proj, shared expert
# gate|up and down, DSA q_a, a small one.
SHAPES = [(12800, 4096), (4096, 8192), (4096, 4096), (3072, 4096), (4096, 2048), (1536, 4096), (96, 4096)]


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_dense_gemv_matches_cublas_in_bf16(n, k, rows):
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    want = x.double() @ weight.double().t()
    got = dense_gemv.dense_gemv(x, weight, sm_count(x.device))
    cublas = x @ weight.t()
    assert ((got.double() - want).norm() / want.norm()).item() < 4e-3
    assert ((cublas.double() - want).norm() / want.norm()).item() < 4e-3


def test_linear_chooses_per_shape_and_replays_it_in_a_graph():
    """Eager calls time both kernels and keep the faster; a graph captured afterwards replays the choice,
    and a shape first seen inside the capture takes cuBLAS."""
    linear = kernel("linear", "cuda")
    weight = DenseWeight((torch.randn(12800, 4096, device="cuda") / 64).bfloat16())
    unseen = DenseWeight((torch.randn(640, 4096, device="cuda") / 64).bfloat16())
    x = torch.randn(3, 4096, device="cuda").bfloat16()
    eager = linear(x, weight)
    assert (3, 12800, 4096, torch.bfloat16, x.device) in dense_gemv.CHOICES.use_triton
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, other = linear(x, weight), linear(x, unseen)
    assert (3, 640, 4096, torch.bfloat16, x.device) not in dense_gemv.CHOICES.use_triton
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(other, x @ unseen.data.t(), rtol=1e-2, atol=1e-2)
