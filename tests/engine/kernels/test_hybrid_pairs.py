"""A hybrid decode step's pair placement and share sum: the Triton kernels (in the interpreter here) against the
torch references, and the references against what they mean."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.experts.hybrid_pairs import place_pairs_torch, place_pairs_triton, stage_host_rows_torch, \
    stage_host_rows_triton, sum_shares_torch, sum_shares_triton
from tests.engine.kernels.sm90 import assert_compiles_for_sm90


def test_place_pairs_counts_every_pair_and_zeroes_the_misses():
    """Repeated experts count once per pair; a miss (slot -1) gets slot 0 and weight 0 and is marked; the kernel
    equals the reference exactly, counts included."""
    g = torch.Generator().manual_seed(0)
    slot_of = torch.full((12,), -1, dtype=torch.long)
    slot_of[torch.tensor([1, 4, 5, 9])] = torch.tensor([3, 0, 2, 1])
    ids = torch.tensor([[1, 2, 4, 11], [4, 5, 1, 0], [9, 9, 3, 4]])  # 9 twice in a row: a dummy batch may
    weights = torch.rand(3, 4, generator=g) + 0.1
    counts = torch.rand(12, generator=g) * 5
    results = []
    for place in (place_pairs_torch, place_pairs_triton):
        c = counts.clone()
        results.append((*place(ids, weights, slot_of, c), c))
    (slots, dw, miss, c), got = results
    hit = slot_of[ids] >= 0
    assert torch.equal(miss, ~hit) and torch.equal(slots, torch.where(hit, slot_of[ids], 0))
    assert torch.equal(dw, torch.where(hit, weights, 0.0))
    assert torch.allclose(c - counts, torch.bincount(ids.flatten(), minlength=12).float(), atol=1e-5)
    for want, have in zip(results[0], got):
        assert have.dtype == want.dtype and torch.equal(have, want)
    with pytest.raises(ValueError, match="decode-sized"):
        place_pairs_triton(torch.zeros(17, 8, dtype=torch.long), torch.ones(17, 8), slot_of, counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fetched,dense", [(True, True), (False, True), (True, False), (False, False)])
def test_sum_shares_adds_in_fp32_and_rounds_like_torch(dtype, fetched, dense):
    """The kernel equals the reference (host rows read through a wider buffer's stride): bit for bit in fp32; in
    bf16 within the interpreter's truncation (the GPU rounds to nearest as torch does: one step of bf16 at each
    of the two roundings). The reference is the fp32 sum rounded once, then the shared expert added as torch
    adds two tensors."""
    g = torch.Generator().manual_seed(1)
    rows, d = 3, 1500  # d: a block and a ragged one
    resident = torch.randn(rows, d, generator=g).to(dtype)
    link = torch.randn(rows, d, generator=g).to(dtype) if fetched else None
    host = torch.randn(rows + 2, d, generator=g)[:rows]
    shared = torch.randn(rows, d, generator=g).to(dtype) if dense else None
    want = sum_shares_torch(resident, link, host, shared)
    got = sum_shares_triton(resident, link, host, shared)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        scale = (want.float() - (shared.float() if dense else 0)).abs() + (shared.float().abs() if dense else 0)
        assert ((got.float() - want.float()).abs() <= 2.0**-6 * scale).all()
    exact = resident.double() + (link.double() if fetched else 0) + host.double()
    if dtype == torch.bfloat16:  # the fp32 sum's own rounding is far below bf16's
        rounded = exact.to(dtype)
        assert torch.equal(want, rounded + shared if dense else rounded)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stage_host_rows_writes_the_rows_ids_and_weights_and_nothing_past_them(dtype):
    """Rows of x (read through a wider buffer's stride, a ragged last block) as fp32, int32 ids as int64, the
    weights as fp32, into buffers sized for more rows: the kernel equals the reference exactly (a widening to
    fp32 and int64 is exact) and leaves the rows past the step's as they were."""
    g = torch.Generator().manual_seed(2)
    rows, d, k, capacity = 3, 1500, 8, 5
    x = torch.randn(rows, d + 7, generator=g).to(dtype)[:, :d]
    ids = torch.randint(0, 288, (rows, k), generator=g, dtype=torch.int32)
    weights = torch.rand(rows, k, generator=g)
    outs = []
    for stage in (stage_host_rows_torch, stage_host_rows_triton):
        bufs = torch.full((capacity, d), 7.0), torch.full((capacity, k), -3, dtype=torch.long), \
            torch.full((capacity, k), 7.0)
        stage(x, ids, weights, *bufs)
        outs.append(bufs)
    for want, got in zip(*outs):
        assert torch.equal(got, want)
    x_out, ids_out, w_out = outs[1]
    assert torch.equal(x_out[:rows], x.float()) and torch.equal(ids_out[:rows], ids.long())
    assert torch.equal(w_out[:rows], weights)
    assert (x_out[rows:] == 7).all() and (ids_out[rows:] == -3).all() and (w_out[rows:] == 7).all()
    with pytest.raises(ValueError, match="contiguous fp32, int64, fp32"):
        stage_host_rows_triton(x, ids, weights, torch.empty(capacity, d), torch.empty(capacity, k),
                               torch.empty(capacity, k))
    with pytest.raises(ValueError, match="stage_host_rows"):  # more rows than the buffers hold
        stage_host_rows_triton(x, ids, weights, torch.empty(2, d), torch.empty(2, k, dtype=torch.long),
                               torch.empty(2, k))


def test_the_kernels_compile_for_sm90(tmp_path):
    assert_compiles_for_sm90("""
from engine.kernels.experts.hybrid_pairs import _place_kernel, _stage_kernel, _sum_kernel
compile_for_sm90(_stage_kernel, dict(x_ptr="*bf16", ids_ptr="*i64", weights_ptr="*fp32", x_dst="i64", ids_dst="i64",
                                     weights_dst="i64"), dict(BLOCK=1024, K_BLOCK=8), 4)
compile_for_sm90(_place_kernel, dict(ids_ptr="*i64", weights_ptr="*fp32", slot_of_ptr="*i64", counts_ptr="*fp32",
                                     slots_ptr="*i64", device_w_ptr="*fp32", miss_ptr="*i8"), dict(BLOCK=128), 4)
for fetched in (True, False):
    compile_for_sm90(_sum_kernel, dict(resident_ptr="*bf16", fetched_ptr="*bf16", host_ptr="*fp32", dense_ptr="*bf16",
                                       out_ptr="*bf16"), dict(HAS_FETCHED=fetched, HAS_DENSE=True, BLOCK=1024), 4)
print("compiled")
""", tmp_path)
