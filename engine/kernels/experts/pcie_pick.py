"""Which missed pairs of a hybrid decode step go over PCIe, how much of each, and where each lands: one launch
on CUDA.

An expert splits into `split_units(inter)` parts of its intermediate rows (gate and up rows, down columns;
the device and the CPU each run theirs and the two add up). Of a step's n missed (token, expert) pairs, in
row-major order, the device takes q = `pcie_share(n * units, percent)` parts, at most `capacity` experts'
worth: the first pairs whole, the next one's first q % units parts; the CPU's host step (cpu_gemv.c) applies
the same rule to the same ids and runs the rest. A whole expert as the unit left one side idle at batch 1,
where a layer misses two or three experts: two misses ran both on the CPU (~2 x 147 us at the H200 host's
rate) while the link, a third of the misses' rate, had nothing to do. The i-th picked pair lands in
staging slot i. The torch reference takes ~20 small launches a MoE layer on the device's path to the
gather; the Triton kernel does it in one program (a decode step has at most DECODE_MAX_PAIRS pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.experts.decode import DECODE_MAX_PAIRS

SPLIT_ROWS = 128  # intermediate rows a part: whole CPU tiles (32), NVFP4 groups (16) and FP8 blocks (128)


def split_units(inter: int) -> int:
    """Parts an expert of intermediate width `inter` splits into between the CPU and the device (1: whole
    experts only, for widths that are not a multiple of SPLIT_ROWS)."""
    return inter // SPLIT_ROWS if inter % SPLIT_ROWS == 0 else 1


def pcie_share(parts: torch.Tensor, percent: int | torch.Tensor) -> torch.Tensor:
    """Of `parts` parts, how many go over PCIe when it moves percent : 100 - percent of what the CPU and the link
    move together: ((parts + 1) * percent - 1) // 100, the count that lets the later of the two sides finish
    soonest (ties to the CPU; cpu_gemv.c's host step computes the same)."""
    return (((parts + 1) * percent - 1) // 100).clamp(min=0)


@register("pcie_pick", "torch")
def pcie_pick_torch(expert_ids: torch.Tensor, weights: torch.Tensor, miss: torch.Tensor, entry_of: torch.Tensor,
                    live_rows: torch.Tensor | None, percent: torch.Tensor, capacity: int,
                    units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids, weights, miss [T, k]; entry_of [E] (expert -> host bank entry); live_rows: rows past it are
    a graph's padding (None: every row is live); percent: the link's share, a 0-d tensor (read at run time,
    so a captured graph follows a new split); units: parts an expert splits into -> (entries [capacity]: the
    host entry each staging slot receives, -1 none; parts [capacity]: how many of its first parts, 0 none;
    slots [T, k]: the staging slot of each picked pair, 0 elsewhere; weights [T, k] fp32, zero where not
    picked)."""
    missed = miss.flatten()
    if live_rows is not None:
        rows = torch.arange(missed.numel(), device=missed.device) // expert_ids.shape[1]
        missed = missed & (rows < live_rows)
    share = pcie_share(missed.sum() * units, percent).clamp(max=capacity * units)
    pair_parts = torch.where(missed, (share - (missed.cumsum(0) - 1) * units).clamp(0, units), 0)
    picked = pair_parts > 0
    taken = picked.cumsum(0) - 1
    at = torch.where(picked, taken, capacity)  # the last: a dump
    entries = torch.full((capacity + 1,), -1, dtype=torch.long, device=missed.device)
    entries.scatter_(0, at, torch.where(picked, entry_of[expert_ids.flatten()], -1))
    parts = torch.zeros(capacity + 1, dtype=torch.long, device=missed.device).scatter_(0, at, pair_parts)
    slots = torch.where(picked, taken, 0).view_as(expert_ids)
    return entries[:capacity], parts[:capacity], slots, weights.float() * picked.view_as(weights)


@triton.jit(do_not_specialize=["pairs"], do_not_specialize_on_alignment=["entry_ptr"])  # one build a model
def _pick_kernel(ids_ptr, weights_ptr, miss_ptr, entry_ptr, live_ptr, percent_ptr, entries_ptr, parts_ptr, slots_ptr,
                 out_w_ptr, pairs, K: tl.constexpr, CAPACITY: tl.constexpr, UNITS: tl.constexpr,
                 HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr, CAP_BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < pairs
    missed = valid & (tl.load(miss_ptr + offs, mask=valid, other=0) != 0)
    if HAS_LIVE:
        missed = missed & (offs // K < tl.load(live_ptr))
    rank = tl.cumsum(missed.to(tl.int32), 0) - 1
    total = tl.sum(missed.to(tl.int32), 0) * UNITS
    share = tl.minimum(tl.maximum(((total + 1) * tl.load(percent_ptr).to(tl.int32) - 1) // 100, 0), CAPACITY * UNITS)
    pair_parts = tl.where(missed, tl.minimum(tl.maximum(share - rank * UNITS, 0), UNITS), 0)
    picked = pair_parts > 0
    taken = tl.cumsum(picked.to(tl.int32), 0) - 1
    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    entry = tl.load(entry_ptr + ids, mask=picked, other=-1)
    # staging slot s receives the entry of the picked pair with taken == s (a match, not a scatter: one store)
    slot = tl.arange(0, CAP_BLOCK)
    match = (taken[None, :] == slot[:, None]) & picked[None, :]
    tl.store(entries_ptr + slot, tl.max(tl.where(match, entry[None, :], -1), axis=1), mask=slot < CAPACITY)
    tl.store(parts_ptr + slot, tl.max(tl.where(match, pair_parts[None, :], 0), axis=1).to(tl.int64),
             mask=slot < CAPACITY)
    tl.store(slots_ptr + offs, tl.where(picked, taken, 0).to(tl.int64), mask=valid)
    w = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_w_ptr + offs, tl.where(picked, w, 0.0), mask=valid)


@register("pcie_pick", "triton")
def pcie_pick_triton(expert_ids: torch.Tensor, weights: torch.Tensor, miss: torch.Tensor, entry_of: torch.Tensor,
                     live_rows: torch.Tensor | None, percent: torch.Tensor, capacity: int,
                     units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As pcie_pick_torch, in one program (at most DECODE_MAX_PAIRS pairs: a decode-sized batch)."""
    pairs = expert_ids.numel()
    if pairs > DECODE_MAX_PAIRS:
        raise ValueError(f"pcie_pick: {pairs} pairs, more than a decode-sized batch ({DECODE_MAX_PAIRS})")
    dev = expert_ids.device
    entries = torch.empty(capacity, dtype=torch.long, device=dev)
    parts = torch.empty(capacity, dtype=torch.long, device=dev)
    slots = torch.empty(expert_ids.shape, dtype=torch.long, device=dev)
    out_w = torch.empty(expert_ids.shape, dtype=torch.float32, device=dev)
    live = live_rows if live_rows is not None else entries  # never read without HAS_LIVE
    _pick_kernel[(1,)](expert_ids.contiguous(), weights.contiguous(), miss.contiguous(), entry_of, live, percent,
                       entries, parts, slots, out_w, pairs, K=expert_ids.shape[1], CAPACITY=capacity,
                       UNITS=units, HAS_LIVE=live_rows is not None, BLOCK=DECODE_MAX_PAIRS,
                       CAP_BLOCK=max(2, triton.next_power_of_2(capacity)), num_warps=4)
    return entries, parts, slots, out_w
