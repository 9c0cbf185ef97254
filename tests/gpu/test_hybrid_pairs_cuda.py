"""The hybrid step's pair placement, host-step staging and share sum, and the clamped SwiGLU, compiled on CUDA
against the torch references (the CPU tests run them in Triton's interpreter, which truncates where the GPU
rounds)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.experts.hybrid_pairs import place_pairs_torch, place_pairs_triton, stage_host_rows_triton, \
    sum_shares_torch, sum_shares_triton
from engine.kernels.swiglu.torch_ref import clamped_swiglu as torch_swiglu
from engine.kernels.swiglu.triton_swiglu import clamped_swiglu as triton_swiglu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.mark.parametrize("rows", [1, 16])
def test_place_pairs_and_sum_shares_equal_torch_bit_for_bit(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    slot_of = torch.where(torch.rand(288, device="cuda", generator=g) < 0.7,
                          torch.randperm(288, device="cuda", generator=g), -1)
    ids = torch.rand(rows, 288, device="cuda", generator=g).topk(8, dim=1).indices
    weights = torch.rand(rows, 8, device="cuda", generator=g)
    counts = torch.rand(288, device="cuda", generator=g) * 100
    want_counts, got_counts = counts.clone(), counts.clone()
    for want, got in zip(place_pairs_torch(ids, weights, slot_of, want_counts),
                         place_pairs_triton(ids, weights, slot_of, got_counts)):
        assert torch.equal(got, want)
    assert torch.equal(got_counts, want_counts)
    resident, fetched, shared = (torch.randn(rows, 4096, device="cuda", generator=g).bfloat16() for _ in range(3))
    host = torch.randn(rows, 4096, device="cuda", generator=g)
    for f in (fetched, None):
        assert torch.equal(sum_shares_triton(resident, f, host, shared), sum_shares_torch(resident, f, host, shared))


def test_stage_host_rows_writes_pinned_memory_eagerly_and_from_a_replayed_graph():
    """The kernel's stores cross the link into pinned host buffers: after a synchronize the host reads the rows
    (bf16 widened to fp32, exactly), the ids and the weights; a captured launch writes each replay's values."""
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, k = 4, 8
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, 288, (rows, k), device="cuda", generator=g)
    weights = torch.rand(rows, k, device="cuda", generator=g)
    bufs = (torch.zeros(16, 4096).pin_memory(), torch.zeros(16, k, dtype=torch.long).pin_memory(),
            torch.zeros(16, k).pin_memory())

    def check() -> None:
        torch.cuda.synchronize()
        assert torch.equal(bufs[0][:rows], x.float().cpu()) and torch.equal(bufs[1][:rows], ids.cpu())
        assert torch.equal(bufs[2][:rows], weights.cpu()) and not bufs[0][rows:].any()

    stage_host_rows_triton(x, ids, weights, *bufs)
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage_host_rows_triton(x, ids, weights, *bufs)
    for seed in (6, 7):
        g.manual_seed(seed)
        x.copy_(torch.randn(rows, 4096, device="cuda", generator=g))
        ids.copy_(torch.randint(0, 288, (rows, k), device="cuda", generator=g))
        weights.copy_(torch.rand(rows, k, device="cuda", generator=g))
        graph.replay()
        check()


def test_clamped_swiglu_within_a_rounding_of_torch():
    """bf16 halves of a stacked projection; exp may differ in its last fp32 bits, so a bf16 rounding may flip."""
    g = torch.Generator(device="cuda").manual_seed(3)
    gate, up = (6 * torch.randn(16, 2 * 2048, device="cuda", generator=g)).bfloat16().split(2048, dim=-1)
    want, got = torch_swiglu(gate, up, 7.0), triton_swiglu(gate, up, 7.0)
    differ = got != want
    assert differ.float().mean() < 1e-3
    assert ((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs()).all()
