"""A hybrid decode step's bookkeeping around its experts, one launch each on CUDA: where each routed pair runs
(`place_pairs`), the CPU's inputs written into its pinned buffers (`stage_host_rows`) and the layer's output
from its shares (`sum_shares`).

Around the expert kernels a MoE layer of a hybrid decode step ran about a dozen tiny torch launches on the
device's path (routing counts, the slot lookup, the hit mask and its inverse, the clamped slots and weights;
casts, three adds and a cast back after): each a few microseconds of launch and gap in the replayed graph, 45
times a step. The host step's inputs were two casts and three copies to pinned memory on the path to the CPU
(the copies each a graph node of a few microseconds); one kernel now writes them there over the link. The torch
versions are the reference (and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register
from engine.kernels.experts.decode import DECODE_MAX_PAIRS


@register("place_pairs", "torch")
def place_pairs_torch(expert_ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                      counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids, weights [T, k]; slot_of [E]: each expert's device slot, -1 in host RAM; counts [E] fp32: the
    routing counts, one added per pair in place -> (slots [T, k], 0 for a miss; the device's weights [T, k] fp32,
    0 for a miss; miss [T, k] bool)."""
    flat = expert_ids.flatten()
    counts.index_add_(0, flat, torch.ones(flat.shape, dtype=counts.dtype, device=flat.device))
    slots = slot_of[expert_ids]
    hit = slots >= 0
    return slots.clamp(min=0), weights.float() * hit, ~hit


@triton.jit(do_not_specialize=["pairs"], do_not_specialize_on_alignment=["slot_of_ptr", "counts_ptr"])
def _place_kernel(ids_ptr, weights_ptr, slot_of_ptr, counts_ptr, slots_ptr, device_w_ptr, miss_ptr, pairs,
                  BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    tl.atomic_add(counts_ptr + ids, tl.full([BLOCK], 1.0, tl.float32), mask=valid)  # +1 each: any order, one sum
    slot = tl.load(slot_of_ptr + ids, mask=valid, other=-1)
    hit = slot >= 0
    w = tl.load(weights_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(slots_ptr + offs, tl.maximum(slot, 0), mask=valid)
    tl.store(device_w_ptr + offs, tl.where(hit, w, 0.0), mask=valid)
    tl.store(miss_ptr + offs, (slot < 0).to(tl.int8), mask=valid)


@register("place_pairs", "triton")
def place_pairs_triton(expert_ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                       counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As place_pairs_torch, in one program (a decode-sized batch: at most DECODE_MAX_PAIRS pairs)."""
    pairs = expert_ids.numel()
    if pairs > DECODE_MAX_PAIRS:
        raise ValueError(f"place_pairs: {pairs} pairs, more than a decode-sized batch ({DECODE_MAX_PAIRS})")
    if slot_of.stride(0) != 1 or counts.stride(0) != 1 or counts.dtype != torch.float32:
        raise ValueError("place_pairs: slot_of and counts need unit strides, counts fp32")
    slots = torch.empty(expert_ids.shape, dtype=slot_of.dtype, device=expert_ids.device)
    device_w = torch.empty(expert_ids.shape, dtype=torch.float32, device=expert_ids.device)
    miss = torch.empty(expert_ids.shape, dtype=torch.bool, device=expert_ids.device)
    _place_kernel[(1,)](expert_ids.contiguous(), weights.contiguous(), slot_of, counts, slots, device_w,
                        miss.view(torch.int8), pairs, BLOCK=DECODE_MAX_PAIRS, num_warps=4)
    return slots, device_w, miss


@register("stage_host_rows", "torch")
def stage_host_rows_torch(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, x_out: torch.Tensor,
                          ids_out: torch.Tensor, weights_out: torch.Tensor) -> None:
    """A host step's inputs into its buffers (host memory, pinned with a GPU; queued on the current stream):
    x [T, D] -> x_out[:T] fp32, expert_ids [T, k] -> ids_out[:T] int64, weights [T, k] -> weights_out[:T] fp32."""
    rows = x.shape[0]
    for dst, src in ((x_out, x), (ids_out, expert_ids), (weights_out, weights)):
        dst[:rows].copy_(src, non_blocking=True)


@triton.jit(do_not_specialize=["x_dst", "ids_dst", "weights_dst"])
def _stage_kernel(x_ptr, ids_ptr, weights_ptr, x_dst, ids_dst, weights_dst, D, K, stride_x, stride_i, stride_w,
                  BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    values = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_dst.to(tl.pointer_type(tl.float32)) + row * D + cols, values, mask=ok)
    if tl.program_id(1) == 0:  # one program a row writes its ids and weights
        k = tl.arange(0, K_BLOCK)
        ok_k = k < K
        ids = tl.load(ids_ptr + row * stride_i + k, mask=ok_k, other=0).to(tl.int64)
        tl.store(ids_dst.to(tl.pointer_type(tl.int64)) + row * K + k, ids, mask=ok_k)
        w = tl.load(weights_ptr + row * stride_w + k, mask=ok_k, other=0.0).to(tl.float32)
        tl.store(weights_dst.to(tl.pointer_type(tl.float32)) + row * K + k, w, mask=ok_k)


@register("stage_host_rows", "triton")
def stage_host_rows_triton(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, x_out: torch.Tensor,
                           ids_out: torch.Tensor, weights_out: torch.Tensor) -> None:
    """As stage_host_rows_torch, in one launch whose stores cross the link into the pinned buffers (their
    addresses, which the device reaches through unified addressing; a stream operation after it sees them)."""
    (rows, d), k = x.shape, expert_ids.shape[1]
    if x_out.dtype != torch.float32 or ids_out.dtype != torch.int64 or weights_out.dtype != torch.float32 or \
            not all(t.is_contiguous() for t in (x_out, ids_out, weights_out)) or \
            x_out.shape[1:] != (d,) or ids_out.shape[1:] != (k,) or weights_out.shape[1:] != (k,) or \
            min(len(x_out), len(ids_out), len(weights_out)) < rows or x.stride(-1) != 1 or \
            expert_ids.stride(-1) != 1 or weights.stride(-1) != 1 or weights.shape != expert_ids.shape:
        raise ValueError(f"stage_host_rows: x {tuple(x.shape)}, ids {tuple(expert_ids.shape)} into buffers "
                         f"{tuple(x_out.shape)} {x_out.dtype}, {tuple(ids_out.shape)} {ids_out.dtype}, "
                         f"{tuple(weights_out.shape)} {weights_out.dtype} (contiguous fp32, int64, fp32)")
    block = 1024
    _stage_kernel[(rows, triton.cdiv(d, block))](
        x, expert_ids, weights, x_out.data_ptr(), ids_out.data_ptr(), weights_out.data_ptr(), d, k, x.stride(0),
        expert_ids.stride(0), weights.stride(0), BLOCK=block, K_BLOCK=max(2, triton.next_power_of_2(k)), num_warps=4)


@register("sum_shares", "torch")
def sum_shares_torch(resident: torch.Tensor, fetched: torch.Tensor | None, host: torch.Tensor,
                     dense: torch.Tensor | None) -> torch.Tensor:
    """The routed sum of the resident experts' share (x's dtype), the link's (x's dtype, or None) and the CPU's
    (fp32), added in fp32 and rounded once to x's dtype; then the shared expert's output (x's dtype, or None)."""
    out = resident.float() if fetched is None else resident.float() + fetched.float()
    out = (out + host).to(resident.dtype)
    return out if dense is None else out + dense


@triton.jit
def _sum_kernel(resident_ptr, fetched_ptr, host_ptr, dense_ptr, out_ptr, D, stride_r, stride_f, stride_h,
                stride_d, stride_o, HAS_FETCHED: tl.constexpr, HAS_DENSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    out = tl.load(resident_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_FETCHED:
        out += tl.load(fetched_ptr + row * stride_f + cols, mask=ok, other=0.0).to(tl.float32)
    out = (out + tl.load(host_ptr + row * stride_h + cols, mask=ok, other=0.0)).to(out_ptr.dtype.element_ty)
    if HAS_DENSE:  # as torch adds two 16-bit tensors: in fp32, rounded once
        out = (out.to(tl.float32) + tl.load(dense_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


@register("sum_shares", "triton")
def sum_shares_triton(resident: torch.Tensor, fetched: torch.Tensor | None, host: torch.Tensor,
                      dense: torch.Tensor | None) -> torch.Tensor:
    """As sum_shares_torch, in one launch (rows of [T, D] read through their strides)."""
    parts = [t for t in (resident, fetched, host, dense) if t is not None]
    if any(t.stride(-1) != 1 or t.shape != resident.shape for t in parts) or host.dtype != torch.float32 or \
            any(t.dtype != resident.dtype for t in (fetched, dense) if t is not None):
        return sum_shares_torch(resident, fetched, host, dense)
    rows, d = resident.shape
    out = torch.empty_like(resident)
    fetched_ = fetched if fetched is not None else resident
    dense_ = dense if dense is not None else resident
    block = 1024
    _sum_kernel[(rows, triton.cdiv(d, block))](
        resident, fetched_, host, dense_, out, d, resident.stride(0), fetched_.stride(0), host.stride(0),
        dense_.stride(0), out.stride(0), HAS_FETCHED=fetched is not None, HAS_DENSE=dense is not None, BLOCK=block,
        num_warps=4)
    return out
