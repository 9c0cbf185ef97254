"""Missed experts gathered from the host bank into device staging slots, all of an expert's tensors in one launch.

Hybrid decode uses it to bring its PCIe share of the misses to the device: staging slot s receives host
bank entry entries[s] (where >= 0), or only its first units[s] of `split_units` parts when the slot holds
the device's part of an expert split with the CPU (the parts are slices of the intermediate rows: gate and
up rows, down columns; `engine/kernels/experts/pcie_pick.py` decides them). Past the split, the gate and up
scales are zeroed, so those rows' outputs, and the SwiGLU of them, are exactly zero and the down columns
there (stale, finite) add nothing: the device runs a staged part with the kernels it runs whole experts
with. The Triton kernel reads the pinned host memory directly over PCIe (a pinned tensor is addressable
from the device) and the entries on the device, so no host decision sits between the router and the copy
and it sits in a captured CUDA graph; its program count is fixed by the shapes (blocks past a split are
not read). It was one launch per tensor (nine for NVFP4), the small ones waiting behind the
codes. The torch version is the reference (and the CPU path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.linear.triton_linear import sm_count
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight, Weight, tensor_fields

BLOCK = 4096  # elements a program copies at a time: 16 KiB of words in flight per program over the link
SPLIT_BY_ROWS = (True, True, False)  # gate and up are split along their rows, down along its columns
ZEROED = {Nvfp4Weight: "scale", Fp8BlockWeight: "scale_inv", DenseWeight: "data"}  # zero past a row split


@dataclass(frozen=True)
class GatherPart:
    """One tensor of an expert stack as [E, outer, split, inner] elements (4-byte words where every part allows,
    else bytes): the split runs along `split` (1 and whole: copied entirely for any part of the expert)."""

    src: torch.Tensor  # [E, n] the host bank's
    dst: torch.Tensor  # [slots, n] the staging stack's
    split: int
    inner: int
    whole: bool
    zero: bool


@dataclass
class GatherPlan:
    """What `gather_experts` copies from one layer's host bank into the staging stacks (built once a layer)."""

    parts: list[GatherPart]
    split_units: int
    table: torch.Tensor | None = None  # the kernel's view of the parts, on the staging device
    blocks: int = 0


def _view(t: torch.Tensor, words: bool) -> torch.Tensor:
    rows = t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)  # explicit: a bank may have no rows
    return rows.view(torch.int32) if words else rows


def gather_plan(staging: tuple[Weight, Weight, Weight], host: tuple[Weight, Weight, Weight],
                split_units: int) -> GatherPlan:
    """The parts of gate, up and down from `host` (stacks [E, ...]) to `staging` (stacks [slots, ...]), an expert
    split into `split_units` parts of its intermediate rows."""
    shapes = []  # (dst, src, split length, inner bytes, whole, zero)
    for by_rows, dst_stack, src_stack in zip(SPLIT_BY_ROWS, staging, host):
        for name in tensor_fields(dst_stack):
            dst, src = getattr(dst_stack, name), getattr(src_stack, name)
            if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
                raise ValueError(f"gather: {name} {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
            shape, size = dst.shape[1:], dst.element_size()
            whole = name == "global_scale" and (not by_rows or math.prod(shape) == 1)
            if whole:
                shapes.append((dst, src, 1, math.prod(shape) * size, True, False))
                continue
            axis = 0 if by_rows else len(shape) - 1
            split, inner = shape[axis], math.prod(shape[axis + 1:]) * size
            if split % split_units:
                raise ValueError(f"gather: {name} {tuple(src.shape)} does not split into {split_units} parts")
            shapes.append((dst, src, split, inner, False, by_rows and name == ZEROED[type(dst_stack)]))
    # words where every part's elements and parts are whole words (the release's shapes), else bytes
    words = all(dst[0].numel() * dst.element_size() % 4 == 0 and
                (inner % 4 == 0 or split * inner % (4 * (1 if whole else split_units)) == 0)
                for dst, _, split, inner, whole, _ in shapes)
    parts = []
    for dst, src, split, inner, whole, zero in shapes:
        if words:
            split, inner = (split, inner // 4) if inner % 4 == 0 else (split * inner // 4, 1)
        parts.append(GatherPart(_view(src, words), _view(dst, words), split, inner, whole, zero))
    plan = GatherPlan(parts, split_units)
    if parts[0].dst.is_cuda:  # made here, not at a first launch that may sit in a graph capture
        plan.table, plan.blocks = _table(plan, parts[0].dst.device)
    return plan


def _check(plan: GatherPlan, entries: torch.Tensor, units: torch.Tensor) -> None:
    slots = plan.parts[0].dst.shape[0]
    if entries.shape != (slots,) or units.shape != (slots,):
        raise ValueError(f"gather: entries {tuple(entries.shape)} and units {tuple(units.shape)} for {slots} slots")


@register("gather_experts", "torch")
def gather_experts_torch(plan: GatherPlan, entries: torch.Tensor, units: torch.Tensor) -> None:
    """Staging slot s <- host entry entries[s] (>= 0), its first units[s] parts (see the module docstring)."""
    _check(plan, entries, units)
    for slot, (entry, part_units) in enumerate(zip(entries.tolist(), units.tolist())):
        if entry < 0:
            continue
        for p in plan.parts:
            dst, src = p.dst[slot].view(-1, p.split, p.inner), p.src[entry].to(p.dst.device).view(-1, p.split, p.inner)
            end = p.split if p.whole else p.split * part_units // plan.split_units
            dst[:, :end] = src[:, :end]
            if p.zero:
                dst[:, end:] = 0


@triton.jit
def _gather_kernel(table_ptr, entries_ptr, units_ptr, PARTS: tl.constexpr, PARTS_BLOCK: tl.constexpr,
                   UNITS: tl.constexpr, ELEMENT: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                   SLOTS: tl.constexpr, SLOTS_BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                   RUNTIME_BOUND: tl.constexpr):
    index = tl.arange(0, PARTS_BLOCK)
    firsts = tl.load(table_ptr + index * 8 + 7, mask=index < PARTS, other=1 << 40)
    s = tl.arange(0, SLOTS_BLOCK)
    staged = tl.max(tl.where(tl.load(entries_ptr + s, mask=s < SLOTS, other=-1) >= 0, s + 1, 0), 0)
    # the blocks of the slots up to the last with an entry (the pick fills the first ones); Triton's interpreter
    # (CPU tensors) takes no loaded bound: it walks every slot's
    bound: tl.constexpr = (SLOTS * BLOCKS + PROGRAMS - 1) // PROGRAMS
    if RUNTIME_BOUND:
        bound = (staged * BLOCKS + PROGRAMS - 1) // PROGRAMS
    for step in tl.range(0, bound):
        item = step * PROGRAMS + tl.program_id(0)
        slot = item // BLOCKS
        block = item - slot * BLOCKS
        entry = tl.load(entries_ptr + slot, mask=slot < SLOTS, other=-1)
        row = table_ptr + (tl.sum((firsts <= block).to(tl.int32), 0) - 1) * 8
        src = tl.load(row).to(tl.pointer_type(ELEMENT))
        dst = tl.load(row + 1).to(tl.pointer_type(ELEMENT))
        n, split, inner = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        end = tl.where(tl.load(row + 5) != 0, split, split * tl.load(units_ptr + slot, mask=entry >= 0) // UNITS)
        offs = (block - tl.load(row + 7)) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        valid = (offs < n) & (entry >= 0)
        copy = valid & ((offs // inner) % split < end)
        values = tl.load(src + entry * n + offs, mask=copy, other=0)
        tl.store(dst + slot.to(tl.int64) * n + offs, values, mask=copy | (valid & (tl.load(row + 6) != 0)))


def _table(plan: GatherPlan, device: torch.device) -> tuple[torch.Tensor, int]:
    """A row of 8 per part (src and dst addresses, elements an expert, split length, inner, whole, zero, its first
    program), and the programs a slot takes."""
    rows, blocks = [], 0
    for p in plan.parts:
        n = p.dst.shape[1]
        rows.append([p.src.data_ptr(), p.dst.data_ptr(), n, p.split, p.inner, int(p.whole), int(p.zero), blocks])
        blocks += triton.cdiv(n, BLOCK)
    return torch.tensor(rows, dtype=torch.int64, device=device), blocks


@register("gather_experts", "triton")
def gather_experts_triton(plan: GatherPlan, entries: torch.Tensor, units: torch.Tensor) -> None:
    """As gather_experts_torch, in one launch for every tensor of the three stacks."""
    _check(plan, entries, units)
    if plan.table is None:  # staging on the CPU (the interpreter's tests)
        plan.table, plan.blocks = _table(plan, plan.parts[0].dst.device)
    element = tl.int32 if plan.parts[0].dst.dtype == torch.int32 else tl.uint8
    # One program an SM, each looping over blocks of the staged slots: every SM reads over the link (a few SMs'
    # reads cannot fill it), and the SMs keep room for the resident experts, which run beside the gather (a
    # program a block filled every SM's slots with programs waiting on the link, and the kernels beside waited).
    slots = len(entries)
    programs = min(sm_count(entries.device), slots * plan.blocks)
    _gather_kernel[(programs,)](plan.table, entries, units, PARTS=len(plan.parts),
                                PARTS_BLOCK=triton.next_power_of_2(len(plan.parts)), UNITS=plan.split_units,
                                ELEMENT=element, BLOCK=BLOCK, BLOCKS=plan.blocks, SLOTS=slots,
                                SLOTS_BLOCK=max(2, triton.next_power_of_2(slots)), PROGRAMS=programs,
                                RUNTIME_BOUND=entries.is_cuda)
