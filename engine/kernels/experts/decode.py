"""Decode-shaped MoE (few tokens): two GEMV launches that stream each selected expert's weights once per pair.

gate/up: one program per (token, expert) pair and BLOCK_N rows of the intermediate dim; it streams
the gate and up rows over all of D, applies the globals and the clamped SwiGLU, and writes h [P, I].
down: one program per token and BLOCK_N output features; it walks the token's k experts and all of
I in a single flattened loop (so the software pipeline runs across expert boundaries), weights each
expert's rows by its routing weight and global, and writes the sum over k: no atomics, deterministic.
Pairs of routing weight zero are skipped, reading nothing: a hybrid step runs every pair with the ones
whose experts are elsewhere weighted zero (about a quarter of the pairs in the resident experts' launch,
all but one or two in the PCIe share's). The gate/up programs write h, and each pair's expert and
weight, with a token's live pairs first (the others after them, h zero), so down walks only the live ones.
h between the two stays fp32 (and in code order for an NVFP4 down stack), like the fp32 copy of x
the gate/up loop reads: no conversion per weight in either loop.
Every shape is static and nothing reads back to the host, so the pair is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.experts.dequant import (
    StackOperands, code_position, gemv_partial, global_multiplier, paired_operands, stack_operands, to_code_order,
)
from engine.kernels.experts.epilogue import clamped_swiglu
from engine.weights import DenseWeight, Nvfp4Weight

# Up to this many (token, expert) pairs the GEMV form wins; past it, the grouped GEMM of `prefill`
# reads each expert once for all its tokens instead of once per pair.
DECODE_MAX_PAIRS = 128


@dataclass(frozen=True)
class DecodeTiles:
    """Compile-time launch shape of the decode kernels (clamped to the dims); tune on the GPU.

    Defaults, from the sm_90 build (registers, shared memory, SASS per weight): a gate/up program
    takes 32 rows x 512 columns of both matrices (126 registers, 43 KiB: 4 programs per SM; 512
    programs at batch 1), a down program 16 rows x 1024 columns (93 registers; 256 programs at batch
    1). Each step brings every thread 16-byte code loads and >= 4-byte scale loads: cp.async, which
    the software pipeline uses, takes nothing narrower, so smaller tiles would load scales unpipelined.
    Decoding then costs about 5 (gate/up) and 6 (down) instructions per weight, ~2.5 of them integer.
    """

    gate_up_n: int = 32
    gate_up_k: int = 512
    down_n: int = 16
    down_k: int = 1024
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, route_ptr, h_ptr, live_ids_ptr, live_route_ptr, live_count_ptr,
                    gw_ptr, gs_ptr, gg_ptr, uw_ptr, us_ptr, ug_ptr, stride_xt, stride_hp,
                    stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn, limit,
                    K: tl.constexpr, TOPK: tl.constexpr, TOPK_BLOCK: tl.constexpr, FP4: tl.constexpr,
                    H_CODE_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // TOPK
    slot = pair - token * TOPK
    first_rows = tl.program_id(1) == 0
    k = tl.arange(0, TOPK_BLOCK)
    live = tl.load(route_ptr + token * TOPK + k, mask=k < TOPK, other=0.0) != 0
    count = tl.sum(live.to(tl.int32), 0)
    route = tl.load(route_ptr + pair)
    earlier = (k < slot).to(tl.int32)
    # the token's live pairs first, in their order, then the others (weight 0, h 0)
    position = token * TOPK + tl.where(route != 0, tl.sum(live.to(tl.int32) * earlier, 0),
                                       count + tl.sum((~live).to(tl.int32) * earlier, 0))
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if first_rows:
        tl.store(live_ids_ptr + position, expert)
        tl.store(live_route_ptr + position, route)
        if slot == 0:
            tl.store(live_count_ptr + token, count)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.zeros([BLOCK_N], tl.float32)
    if route != 0:
        x_row = x_ptr + token * stride_xt
        gw_ptr += expert * stride_we
        uw_ptr += expert * stride_we
        gs_ptr += expert * stride_se
        us_ptr += expert * stride_se
        acc_gate = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            x = tl.load(x_row + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
            acc_gate += gemv_partial(gw_ptr, gs_ptr, rows, k0, x, stride_wn, stride_sn, FP4, BLOCK_K)
            acc_up += gemv_partial(uw_ptr, us_ptr, rows, k0, x, stride_wn, stride_sn, FP4, BLOCK_K)
        gate = tl.sum(acc_gate, axis=1) * global_multiplier(gg_ptr + expert * stride_ge, rows, stride_gn, FP4)
        up = tl.sum(acc_up, axis=1) * global_multiplier(ug_ptr + expert * stride_ge, rows, stride_gn, FP4)
        h = clamped_swiglu(gate, up, limit)
    h_cols = rows
    if H_CODE_ORDER:  # h meets an NVFP4 down stack
        h_cols = code_position(rows)
    tl.store(h_ptr + position * stride_hp + h_cols, h)


@triton.jit
def _down_kernel(h_ptr, live_ids_ptr, live_route_ptr, live_count_ptr, out_ptr, w_ptr, s_ptr, g_ptr,
                 stride_hp, stride_ot,
                 stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_gn,
                 K: tl.constexpr, TOPK: tl.constexpr, FP4: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, RUNTIME_BOUND: tl.constexpr):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    steps: tl.constexpr = K // BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
    live = tl.load(live_count_ptr + token)
    # Triton's interpreter (CPU tensors) takes no loaded bound: it walks every pair, the dead ones selected out
    bound: tl.constexpr = TOPK * steps
    if RUNTIME_BOUND:
        bound = live * steps
    for step in tl.range(0, bound, num_stages=NUM_STAGES):
        rank = step // steps
        k0 = (step - rank * steps) * BLOCK_K
        pair = token * TOPK + rank
        expert = tl.load(live_ids_ptr + pair)  # uniform scalar loads: L1 hits after the first
        h = tl.load(h_ptr + pair * stride_hp + k0 + tl.arange(0, BLOCK_K))
        partial = gemv_partial(w_ptr + expert * stride_we, s_ptr + expert * stride_se, rows, k0, h,
                               stride_wn, stride_sn, FP4, BLOCK_K)
        scale = tl.load(live_route_ptr + pair) * global_multiplier(g_ptr + expert * stride_ge, rows, stride_gn, FP4)
        acc += tl.where(rank < live, partial * scale[:, None], 0.0)
    tl.store(out_ptr + token * stride_ot + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


def tile(dim: int, want: int) -> int:
    """The tile along `dim`: `want` (a power of two) clamped to the largest power of two dividing the dim,
    since Triton's blocks are powers of two and the hot loops have no masks."""
    return min(want, dim & -dim)


def _columns(nvfp4_columns: int, stack: StackOperands) -> int:
    """The K tile for a stack: dense ones take as many bytes per row as the NVFP4 tile (half a byte a weight)."""
    return nvfp4_columns if stack.fp4 else max(16, nvfp4_columns // (2 * stack.weights.element_size()))


def moe_decode(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
               gate: DenseWeight | Nvfp4Weight, up: DenseWeight | Nvfp4Weight, down: DenseWeight | Nvfp4Weight,
               limit: float, tiles: DecodeTiles = DecodeTiles()) -> torch.Tensor:
    """x [T, D]; expert_ids [T, k]; weights [T, k] -> sum_k w * down(clamped_swiglu(gate x, up x)) [T, D]."""
    tokens, hidden = x.shape
    topk = expert_ids.shape[1]
    inter = gate.shape[1]
    g, u = paired_operands(gate, up)
    d = stack_operands(down)
    # fp32 activations: the loop reads them from shared memory without a conversion per weight.
    acts = to_code_order(x, torch.float32) if g.fp4 else x.float().contiguous()
    ids = expert_ids.contiguous()
    route = weights.contiguous().float()
    h = torch.empty(tokens * topk, inter, dtype=torch.float32, device=x.device)
    live_ids = torch.empty(tokens * topk, dtype=torch.int64, device=x.device)
    live_route = torch.empty(tokens * topk, dtype=torch.float32, device=x.device)
    live_count = torch.empty(tokens, dtype=torch.int32, device=x.device)
    bn, bk = tile(inter, tiles.gate_up_n), tile(hidden, _columns(tiles.gate_up_k, g))
    _gate_up_kernel[(tokens * topk, inter // bn)](
        acts, ids, route, h, live_ids, live_route, live_count, *g.tensors(), *u.tensors(), acts.stride(0),
        h.stride(0), *g.strides(), limit, K=hidden, TOPK=topk, TOPK_BLOCK=triton.next_power_of_2(topk),
        FP4=g.fp4, H_CODE_ORDER=d.fp4, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=tiles.num_stages,
        num_warps=tiles.num_warps)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    bn, bk = tile(hidden, tiles.down_n), tile(inter, _columns(tiles.down_k, d))
    _down_kernel[(tokens, hidden // bn)](
        h, live_ids, live_route, live_count, out, *d.tensors(), h.stride(0), out.stride(0), *d.strides(),
        K=inter, TOPK=topk, FP4=d.fp4, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=tiles.num_stages,
        RUNTIME_BOUND=x.is_cuda, num_warps=tiles.num_warps)
    return out
