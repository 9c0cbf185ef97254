"""The one-program pick of a decode step's PCIe share (Triton, in the interpreter here) against its torch
reference: the same staging entries, parts, slots and weights, exactly, over ragged batches, live rows,
every share, whole and split experts and a full staging area."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.experts.pcie_pick import pcie_pick_torch, pcie_pick_triton, pcie_share
from tests.engine.kernels.sm90 import assert_compiles_for_sm90

E, K = 24, 4


def case(rows: int, seed: int, miss_rate: float) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(rows)])
    weights = torch.rand(rows, K, generator=gen)
    hosted = torch.rand(E, generator=gen) < miss_rate  # the rest sit in device slots
    entry_of = torch.where(hosted, hosted.cumsum(0) - 1, -1)
    return ids, weights, entry_of[ids] >= 0, entry_of


@pytest.mark.parametrize("units", [1, 16])
@pytest.mark.parametrize("percent", [0, 34, 50, 100])
@pytest.mark.parametrize("rows,live,capacity", [(1, None, 8), (3, None, 2), (8, 5, 8), (32, 32, 8), (16, 0, 4)])
def test_the_kernel_picks_what_the_reference_picks(percent, rows, live, capacity, units):
    ids, weights, miss, entry_of = case(rows, 7 * rows + percent, 0.6)
    live_rows = None if live is None else torch.tensor(live)
    share = torch.tensor(percent)
    want = pcie_pick_torch(ids, weights, miss, entry_of, live_rows, share, capacity, units)
    got = pcie_pick_triton(ids, weights, miss, entry_of, live_rows, share, capacity, units)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("units", [1, 16])
def test_the_reference_sends_the_share_the_rule_gives_and_fills_slots_in_order(units):
    """Two live rows of four misses at 50%: of 8 * units parts, the first pairs go whole, in order into the
    slots, the next one its remaining parts, while the three slots last; the padding row sends nothing."""
    ids = torch.arange(12).view(3, 4)
    weights = torch.rand(3, 4)
    miss = torch.ones(3, 4, dtype=torch.bool)
    entry_of = torch.arange(E) + 100
    entries, parts, slots, picked = pcie_pick_torch(ids, weights, miss, entry_of, torch.tensor(2), torch.tensor(50), 3,
                                                    units)
    share = min(int(pcie_share(torch.tensor(8 * units), 50)), 3 * units)
    want = [min(units, share - r * units) for r in range(3) if share > r * units]
    assert parts.tolist()[:len(want)] == want and sum(parts.tolist()) == share
    assert entries.tolist()[:len(want)] == [100 + r for r in range(len(want))]  # ranks 0, 1, ... in order
    assert slots.flatten()[:len(want)].tolist() == list(range(len(want))) and not picked[2].any()  # padding
    assert torch.equal(picked.flatten()[:len(want)], weights.flatten()[:len(want)])
    assert int((picked != 0).sum()) == len(want) <= 3  # the staging area bounds the share
    entries, parts, _, _ = pcie_pick_torch(ids, weights, miss, entry_of, torch.tensor(1), torch.tensor(33), 8, 16)
    assert entries.tolist()[:2] == [100, 101] and parts.tolist()[:3] == [16, 5, 0]  # 21 of 64 parts


def test_more_pairs_than_a_decode_batch_is_refused():
    ids, weights, miss, entry_of = case(40, 1, 0.5)  # 160 pairs
    with pytest.raises(ValueError, match="decode-sized"):
        pcie_pick_triton(ids, weights, miss, entry_of, None, torch.tensor(50), 8, 16)


def test_the_kernel_compiles_for_sm90(tmp_path):
    """Both builds a model serves (inside a captured graph, with live rows; eager, without) compile for sm_90."""
    assert_compiles_for_sm90("""
from engine.kernels.experts.pcie_pick import _pick_kernel
pointers = dict(ids_ptr="*i64", weights_ptr="*fp32", miss_ptr="*i1", entry_ptr="*i64", live_ptr="*i64",
                percent_ptr="*i64", entries_ptr="*i64", parts_ptr="*i64", slots_ptr="*i64", out_w_ptr="*fp32")
for live in (True, False):
    compile_for_sm90(_pick_kernel, pointers, dict(K=8, CAPACITY=8, UNITS=16, HAS_LIVE=live, BLOCK=128, CAP_BLOCK=8),
                     4)
print("compiled")
""", tmp_path)
