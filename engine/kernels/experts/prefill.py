"""Prefill-shaped MoE (many tokens): grouped GEMMs over (token, expert) pairs sorted and padded per expert.

`align_by_expert` groups the T*k pairs by expert in one device program and pads each expert's
run to BLOCK_M rows (the moe-align layout); the number of row blocks is a static bound, blocks past
the end carry expert id E and exit at once. Each program of the gate/up launch multiplies one block
of rows by BLOCK_N rows of its expert's gate and up (tiles dequantized in registers, tl.dot on the
activation dtype), applies the globals and the clamped SwiGLU and writes h per pair. The down launch
does the same over h, scales by the routing weight and writes one row per pair; the sum over k is a
plain reduction of those rows afterwards, so the result is deterministic. No host sync anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.experts.decode import tile
from engine.kernels.experts.dequant import (
    code_position, global_multiplier, paired_operands, stack_operands, to_code_order, weight_tile,
)
from engine.kernels.experts.epilogue import clamped_swiglu
from engine.kernels.token_variants import token_variants
from engine.weights import DenseWeight, Nvfp4Weight


@dataclass(frozen=True)
class PrefillTiles:
    """Compile-time launch shape of the prefill kernels (clamped to the dims); tune on the GPU.

    block_m None picks 16, 32 or 64 rows from the mean pairs per expert, so short prompts do not
    multiply mostly padding (64 rows take wgmma, fewer mma.sync), and 128 from 128 pairs an expert on: the
    weight tile's dequantization is paid once per row block, so 128 rows halve it per FLOP. block_k None: 128
    up to 64 rows (a 64-row NVFP4 scale tile of 512 bytes, 4 per thread, the least cp.async pipelines; at 64
    they load synchronously), 64 at 128 rows. weights_first None: on at 128 rows, the dequantized weights as the
    MMA's first operand (`_zeros` says why). Timed on an H100 at the release's experts (ops/bench_experts.py,
    8,192 / 32,768 tokens, ms a layer): 64 rows 16.0 / 57.8; 128 rows on 8 warps in 2 stages 15.4 / 55.9; 128
    rows with the weights first on 4 warps in 3 stages 12.5 / 46.9 (8 warps: 20.3 / 71.9).
    """

    block_m: int | None = None
    block_n: int = 64
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    weights_first: bool | None = None


class Launch(NamedTuple):
    """The shape one prefill launch takes: rows, K block, warps, pipeline stages, the MMA's operand order."""

    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    weights_first: bool


@triton.jit(do_not_specialize=["pairs", "blocks"])  # per-step counts: one build for all
def _align_kernel(ids_ptr, work_ptr, rows_ptr, block_expert_ptr, pairs, blocks, EXPERTS: tl.constexpr,
                  EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr):
    """One program: count the pairs per expert, lay the experts' padded runs end to end (block experts,
    padding rows), then place each pair at its expert's next free row (an atomic cursor per expert).
    work: 2 * EXPERTS_POW2 int32 zeros (counts, then cursors)."""
    start = 0
    while start < pairs:
        at = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + at, mask=at < pairs, other=0)
        tl.atomic_add(work_ptr + expert, 1, mask=at < pairs)
        start += CHUNK
    tl.debug_barrier()
    experts = tl.arange(0, EXPERTS_POW2)
    real = experts < EXPERTS
    counts = tl.load(work_ptr + experts, mask=real, other=0, volatile=True)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(work_ptr + EXPERTS_POW2 + experts, end - padded, mask=real)  # cursors start at each run's first row
    block = 0
    while block < blocks:  # a block's expert: how many runs end at or before its first row (EXPERTS: none left)
        at = block + tl.arange(0, BLOCKS_CHUNK)
        ended = (end[None, :] <= (at * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_expert_ptr + at, tl.sum(ended.to(tl.int32), 1), mask=at < blocks)
        block += BLOCKS_CHUNK
    row = 0
    while row < blocks * BLOCK_M:  # padding, until a pair takes the row
        at = row + tl.arange(0, CHUNK)
        tl.store(rows_ptr + at, tl.zeros([CHUNK], tl.int32) + pairs, mask=at < blocks * BLOCK_M)
        row += CHUNK
    tl.debug_barrier()
    start = 0
    while start < pairs:
        at = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + at, mask=at < pairs, other=0)
        slot = tl.atomic_add(work_ptr + EXPERTS_POW2 + expert, 1, mask=at < pairs)
        tl.store(rows_ptr + slot, at, mask=at < pairs)
        start += CHUNK


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] expert ids -> (pair index per padded row [B * block_m], expert per row block [B]).

    Each expert's pairs fill whole blocks of block_m rows (one launch; pairs of an expert in no particular
    order: each row of a block is computed on its own). Padding rows hold T*k; row blocks past the last
    expert's hold `num_experts`. B is the static bound cdiv(T*k, block_m) + min(E, T*k): each expert that
    gets pairs adds at most one part block.
    """
    flat = expert_ids.flatten().to(torch.int32)
    pairs = flat.numel()
    blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    pow2 = triton.next_power_of_2(num_experts)
    work = torch.zeros(2 * pow2, dtype=torch.int32, device=flat.device)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, work, rows, block_expert, pairs, blocks, EXPERTS=num_experts, EXPERTS_POW2=pow2,
                        BLOCK_M=block_m, CHUNK=1024, BLOCKS_CHUNK=max(16, 32768 // pow2), num_warps=8)
    return rows, block_expert


@triton.jit
def _dot_step(acc, a, w_ptr, s_ptr, cols, k0, stride_wn, stride_sn, FP4: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_F32: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    """acc + a [M, BLOCK_K] @ (the expert's rows `cols`, columns k0 ..)^T, the tile dequantized to a's dtype;
    WEIGHTS_FIRST: acc^T + that tile @ a^T instead (acc [N, M]; see `_zeros`).

    DOT_F32 multiplies in IEEE fp32 instead: fp32 activations (tf32 would lose ~3 digits) and the
    interpreter, whose tl.dot cannot multiply 16-bit floats.
    """
    dtype: tl.constexpr = tl.float32 if DOT_F32 else a.dtype
    precision: tl.constexpr = "ieee" if DOT_F32 else None
    w = weight_tile(w_ptr, s_ptr, cols, k0, stride_wn, stride_sn, FP4, BLOCK_K, dtype)
    if WEIGHTS_FIRST:  # one return: the compiler types every return statement, taken or not
        acc = tl.dot(w, tl.trans(a.to(dtype)), acc, input_precision=precision)
    else:
        acc = tl.dot(a.to(dtype), tl.trans(w), acc, input_precision=precision)
    return acc


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    """A kernel's fp32 accumulator: [M, N], or [N, M] with the weights as the MMA's first operand. On sm_90 that
    operand may come from registers (the dequantized tile never goes through shared memory) while the rows
    stream into shared memory, so the MMA runs asynchronously beside the next tile's dequantization."""
    return tl.zeros((BLOCK_N, BLOCK_M) if WEIGHTS_FIRST else (BLOCK_M, BLOCK_N), tl.float32)


@triton.jit
def _rows_first(acc, WEIGHTS_FIRST: tl.constexpr):
    """An accumulator of `_zeros` as [M, N]."""
    return tl.trans(acc) if WEIGHTS_FIRST else acc


@triton.jit
def sorted_block(rows_ptr, block_expert_ptr, block, pairs, BLOCK_M: tl.constexpr):
    """Row block `block` of the pairs sorted by expert: (its expert, its pair ids, which ids are real)."""
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pair, pair < pairs


@triton.jit(do_not_specialize=["pairs", "experts"])  # per-step counts: one build for all
def _gate_up_kernel(x_ptr, rows_ptr, block_expert_ptr, h_ptr, gw_ptr, gs_ptr, gg_ptr, uw_ptr, us_ptr, ug_ptr,
                    pairs, experts, stride_xt, stride_hp,
                    stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, limit,
                    K: tl.constexpr, N_TILES: tl.constexpr, TOPK: tl.constexpr, FP4: tl.constexpr,
                    H_CODE_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    block = tl.program_id(0) // N_TILES  # feature tiles of one row block run side by side
    cols = (tl.program_id(0) % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert, pair, live = sorted_block(rows_ptr, block_expert_ptr, block, pairs, BLOCK_M)
    if expert >= experts:  # a padding block past the last expert's rows
        return
    x_rows = x_ptr + (pair // TOPK)[:, None] * stride_xt
    gw_ptr += expert * stride_we
    uw_ptr += expert * stride_we
    gs_ptr += expert * stride_se
    us_ptr += expert * stride_se
    acc_gate = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_FIRST)
    acc_up = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_FIRST)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=live[:, None], other=0.0)
        acc_gate = _dot_step(acc_gate, x, gw_ptr, gs_ptr, cols, k0, stride_wn, stride_sn, FP4, BLOCK_K, DOT_F32,
                             WEIGHTS_FIRST)
        acc_up = _dot_step(acc_up, x, uw_ptr, us_ptr, cols, k0, stride_wn, stride_sn, FP4, BLOCK_K, DOT_F32,
                           WEIGHTS_FIRST)
    gate_global = global_multiplier(gg_ptr + expert * stride_ge, cols, stride_gn, FP4)
    gate = _rows_first(acc_gate, WEIGHTS_FIRST) * gate_global[None, :]
    up_global = global_multiplier(ug_ptr + expert * stride_ge, cols, stride_gn, FP4)
    up = _rows_first(acc_up, WEIGHTS_FIRST) * up_global[None, :]
    h = clamped_swiglu(gate, up, limit)
    h_cols = cols
    if H_CODE_ORDER:  # h meets an NVFP4 down stack
        h_cols = code_position(cols)
    tl.store(h_ptr + pair[:, None] * stride_hp + h_cols[None, :], h.to(h_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["pairs", "experts"])  # per-step counts: one build for all
def _down_kernel(h_ptr, rows_ptr, block_expert_ptr, route_ptr, y_ptr, w_ptr, s_ptr, g_ptr,
                 pairs, experts, stride_hp, stride_yp,
                 stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                 K: tl.constexpr, N_TILES: tl.constexpr, FP4: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    block = tl.program_id(0) // N_TILES
    cols = (tl.program_id(0) % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert, pair, live = sorted_block(rows_ptr, block_expert_ptr, block, pairs, BLOCK_M)
    if expert >= experts:  # a padding block past the last expert's rows
        return
    h_rows = h_ptr + pair[:, None] * stride_hp
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    acc = _zeros(BLOCK_M, BLOCK_N, WEIGHTS_FIRST)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        h = tl.load(h_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=live[:, None], other=0.0)
        acc = _dot_step(acc, h, w_ptr, s_ptr, cols, k0, stride_wn, stride_sn, FP4, BLOCK_K, DOT_F32, WEIGHTS_FIRST)
    route = tl.load(route_ptr + pair, mask=live, other=0.0)
    acc = _rows_first(acc, WEIGHTS_FIRST)
    y = acc * global_multiplier(g_ptr + expert * stride_ge, cols, stride_gn, FP4)[None, :] * route[:, None]
    tl.store(y_ptr + pair[:, None] * stride_yp + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=live[:, None])


def _tile(pairs: int, experts: int, tiles: PrefillTiles, f32: bool) -> Launch:
    """The launch shape of the kernels for `pairs` (token, expert) pairs over `experts` experts."""
    block_m = tiles.block_m
    if block_m is None:
        mean = pairs / experts
        block_m = 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean < 128 else 128
    if f32:  # IEEE fp32 dots run on the FMA units: smaller tiles stay in registers
        block_m = min(block_m, 32)
    wide = block_m >= 128
    block_k = tiles.block_k or (64 if wide else 128)
    weights_first = wide if tiles.weights_first is None else tiles.weights_first
    return Launch(block_m, min(block_k, 32) if f32 else block_k, tiles.num_warps or 4, tiles.num_stages or 3,
                  weights_first)


_LAYERS_RUN: set[tuple[int, int, PrefillTiles, bool]] = set()  # (top-k, experts, tiles, fp32) run so far


@token_variants
def _builds(tokens: int) -> tuple:
    """The tile a step of `tokens` tokens takes in each kind of MoE layer run so far."""
    return tuple(_tile(tokens * topk, experts, tiles, f32)
                 for topk, experts, tiles, f32 in sorted(_LAYERS_RUN, key=repr))


def moe_prefill(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                gate: DenseWeight | Nvfp4Weight, up: DenseWeight | Nvfp4Weight, down: DenseWeight | Nvfp4Weight,
                limit: float, tiles: PrefillTiles = PrefillTiles()) -> torch.Tensor:
    """x [T, D]; expert_ids [T, k]; weights [T, k] -> sum_k w * down(clamped_swiglu(gate x, up x)) [T, D]."""
    tokens, hidden = x.shape
    topk = expert_ids.shape[1]
    experts, inter = gate.shape[0], gate.shape[1]
    pairs = tokens * topk
    g, u = paired_operands(gate, up)
    d = stack_operands(down)
    acts = to_code_order(x, x.dtype) if g.fp4 else x.contiguous()
    route = weights.contiguous().float()
    layer = (topk, experts, tiles, x.dtype == torch.float32)
    _LAYERS_RUN.add(layer)
    launch = _tile(pairs, *layer[1:])
    block_k = launch.block_k
    rows, block_expert = align_by_expert(expert_ids, experts, launch.block_m)
    dot_f32 = x.dtype == torch.float32 or not x.is_cuda  # see _dot_step
    common = dict(BLOCK_M=launch.block_m, NUM_STAGES=launch.num_stages, DOT_F32=dot_f32,
                  WEIGHTS_FIRST=launch.weights_first, num_warps=launch.num_warps)

    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    bn, bk = tile(inter, tiles.block_n), tile(hidden, block_k)
    _gate_up_kernel[(block_expert.numel() * (inter // bn),)](
        acts, rows, block_expert, h, *g.tensors(), *u.tensors(), pairs, experts, acts.stride(0), h.stride(0),
        *g.strides(), limit, K=hidden, N_TILES=inter // bn, TOPK=topk, FP4=g.fp4, H_CODE_ORDER=d.fp4,
        BLOCK_N=bn, BLOCK_K=bk, **common)

    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    bn, bk = tile(hidden, tiles.block_n), tile(inter, block_k)
    _down_kernel[(block_expert.numel() * (hidden // bn),)](
        h, rows, block_expert, route, y, *d.tensors(), pairs, experts, h.stride(0), y.stride(0), *d.strides(),
        K=inter, N_TILES=hidden // bn, FP4=d.fp4, BLOCK_N=bn, BLOCK_K=bk, **common)
    return y.view(tokens, topk, hidden).sum(1)
