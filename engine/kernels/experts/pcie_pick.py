"""Which missed pairs of a hybrid decode step go over PCIe, and where each lands: one launch on CUDA.

Of a step's missed (token, expert) pairs in row-major order, the pair of miss rank r goes over PCIe if
((r + 2) * percent - 1) // 100 > ((r + 1) * percent - 1) // 100 (`to_pcie`; the CPU's host step
applies the same rule to the same ids) while staging slots last; the i-th picked pair lands in
staging slot i. The torch reference takes ~20 small launches a MoE layer on the device's path to the
gather; the Triton kernel does it in one program (a decode step has at most DECODE_MAX_PAIRS pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.experts.decode import DECODE_MAX_PAIRS


def to_pcie(rank: torch.Tensor, percent: int) -> torch.Tensor:
    """Whether the missed pair of rank r goes over PCIe (cpu_gemv.c's host step applies the same rule): n
    misses send k(n) = ((n + 1) * percent - 1) // 100 of them, the count that lets the later of the two
    sides finish soonest when PCIe moves percent : 100 - percent of what the CPU and the link move together
    (ties to the CPU). A layer of a batch-1 step misses one to three experts: a rounded-down share sent
    none at 41%, a rounded-half-up one sent a lone miss over the slower link at 50%."""
    return ((rank + 2) * percent - 1) // 100 > ((rank + 1) * percent - 1) // 100


@register("pcie_pick", "torch")
def pcie_pick_torch(expert_ids: torch.Tensor, weights: torch.Tensor, miss: torch.Tensor, entry_of: torch.Tensor,
                    live_rows: torch.Tensor | None, percent: int,
                    capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids, weights, miss [T, k]; entry_of [E] (expert -> host bank entry); live_rows: rows past it are
    a graph's padding (None: every row is live) -> (entries [capacity]: the host entry each staging slot
    receives, -1 none; slots [T, k]: the staging slot of each picked pair, 0 elsewhere; weights [T, k] fp32,
    zero where not picked)."""
    missed = miss.flatten()
    if live_rows is not None:
        rows = torch.arange(missed.numel(), device=missed.device) // expert_ids.shape[1]
        missed = missed & (rows < live_rows)
    picked = missed & to_pcie(missed.cumsum(0) - 1, percent)
    taken = picked.cumsum(0) - 1
    picked &= taken < capacity
    entries = torch.full((capacity + 1,), -1, dtype=torch.long, device=missed.device)  # the last: a dump
    entries.scatter_(0, torch.where(picked, taken, capacity), torch.where(picked, entry_of[expert_ids.flatten()], -1))
    slots = torch.where(picked, taken, 0).view_as(expert_ids)
    return entries[:capacity], slots, weights.float() * picked.view_as(weights)


@triton.jit(do_not_specialize=["pairs"], do_not_specialize_on_alignment=["entry_ptr"])  # one build a model
def _pick_kernel(ids_ptr, weights_ptr, miss_ptr, entry_ptr, live_ptr, entries_ptr, slots_ptr, out_w_ptr, pairs,
                 K: tl.constexpr, PERCENT: tl.constexpr, CAPACITY: tl.constexpr, HAS_LIVE: tl.constexpr,
                 BLOCK: tl.constexpr, CAP_BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < pairs
    missed = valid & (tl.load(miss_ptr + offs, mask=valid, other=0) != 0)
    if HAS_LIVE:
        missed = missed & (offs // K < tl.load(live_ptr))
    rank = tl.cumsum(missed.to(tl.int32), 0) - 1
    picked = missed & (((rank + 2) * PERCENT - 1) // 100 > ((rank + 1) * PERCENT - 1) // 100)
    taken = tl.cumsum(picked.to(tl.int32), 0) - 1
    picked = picked & (taken < CAPACITY)
    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    entry = tl.load(entry_ptr + ids, mask=picked, other=-1)
    # staging slot s receives the entry of the picked pair with taken == s (a match, not a scatter: one store)
    slot = tl.arange(0, CAP_BLOCK)
    match = (taken[None, :] == slot[:, None]) & picked[None, :]
    tl.store(entries_ptr + slot, tl.max(tl.where(match, entry[None, :], -1), axis=1), mask=slot < CAPACITY)
    tl.store(slots_ptr + offs, tl.where(picked, taken, 0).to(tl.int64), mask=valid)
    w = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_w_ptr + offs, tl.where(picked, w, 0.0), mask=valid)


@register("pcie_pick", "triton")
def pcie_pick_triton(expert_ids: torch.Tensor, weights: torch.Tensor, miss: torch.Tensor, entry_of: torch.Tensor,
                     live_rows: torch.Tensor | None, percent: int,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As pcie_pick_torch, in one program (at most DECODE_MAX_PAIRS pairs: a decode-sized batch)."""
    pairs = expert_ids.numel()
    if pairs > DECODE_MAX_PAIRS:
        raise ValueError(f"pcie_pick: {pairs} pairs, more than a decode-sized batch ({DECODE_MAX_PAIRS})")
    dev = expert_ids.device
    entries = torch.empty(capacity, dtype=torch.long, device=dev)
    slots = torch.empty(expert_ids.shape, dtype=torch.long, device=dev)
    out_w = torch.empty(expert_ids.shape, dtype=torch.float32, device=dev)
    live = live_rows if live_rows is not None else entries  # never read without HAS_LIVE
    _pick_kernel[(1,)](expert_ids.contiguous(), weights.contiguous(), miss.contiguous(), entry_of, live, entries,
                       slots, out_w, pairs, K=expert_ids.shape[1], PERCENT=percent, CAPACITY=capacity,
                       HAS_LIVE=live_rows is not None, BLOCK=DECODE_MAX_PAIRS,
                       CAP_BLOCK=max(2, triton.next_power_of_2(capacity)), num_warps=4)
    return entries, slots, out_w
