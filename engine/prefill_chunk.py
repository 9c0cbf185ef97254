"""How many prompt tokens a step with no decoding request takes under hybrid offload, where the options leave it
open (`max_prefill_tokens` unset): chosen by the memory plan from the link's measured rate and the free memory.

A prefill chunk routes dozens of pairs to every expert (2,048 tokens x 8 of 288: ~57 each), so each chunk
brings every host expert of a layer over PCIe once, layer L+1's while layer L computes: a layer costs
max(link, math), the link's part fixed by the host bank's bytes, the math's growing with the chunk. The chosen
chunk is the shortest multiple of the decode steps' budget whose math covers its link (the link then hides
behind the GPU's work), and no longer: its transient tensors come out of the experts' device slots, which every
decode step reads. The memory plan caps it where its reserve would take more than MOST_RESERVE_SHARE of the
memory an automatic expert budget has, and at max_model_len.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from engine.config import ModelConfig

log = logging.getLogger("glmflash.engine")

# A layer's whole prefill (mixer, router, shared and routed experts, mHC) per token over its routed experts'
# matmul FLOPs at the device's measured bf16 matmul rate. Calibrated on an H100: the resident 8-layer slice at
# 8,192 tokens took 3.41 us a layer a token (36,650 tok/s, ops/BENCHMARKS.md), and this probe's matmul ran at
# 551-611 TFLOP/s there: 3.41 us x 581 TFLOP/s over 402.7 MFLOP of routed experts a token = 4.9.
PREFILL_OVER_EXPERT_MATMUL = 4.9
# Of the experts' device memory, the most a chunk's reserve beyond a decode step's takes. Decode pays for it: on an
# H200 with the whole model 1/32 is ~3.7 GiB, ~7 of ~209 expert slots a layer, ~8% more host bytes a decode step
# (which the host's read bounds); a 4,096-token chunk then fits at the release's shapes, twice the prefill rate of
# 2,048-token chunks at the link's bound.
MOST_RESERVE_SHARE = 1 / 32
_LINK_PROBE_BYTES = 64 << 20  # ~1.3 ms at 50 GB/s: long enough to time, short beside a start
_MATMUL_PROBE = (2048, 4096, 4096)  # a chunk's rows through an expert-sized projection
_MATMUL_WARM_CALLS = 100  # 11-90 ms at 600-78 TFLOP/s: the clocks up before the timed calls


@dataclass(frozen=True)
class PrefillRates:
    """What a prefill chunk's cost follows on this machine, measured before the load."""

    link: float  # bytes a second, pinned host memory to the device
    matmul: float  # FLOP a second of a bf16 matmul of a chunk's shape


def _best_seconds(device: torch.device, runs: int, fn, warm: int = 1) -> float:
    """Shortest of `runs` timed calls after `warm` untimed ones, the device waited for."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measured_prefill_rates(device: torch.device) -> PrefillRates | None:
    """The link's and the matmul's rates on `device` (tens of milliseconds); None without a GPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    link = _LINK_PROBE_BYTES / _best_seconds(device, 3, lambda: target.copy_(host, non_blocking=True))
    m, n, k = _MATMUL_PROBE
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    # a GPU fresh from idle runs its first milliseconds at low clocks (a start measured 69-78 TFLOP/s on an H100
    # that gives ~600 once busy): tens of milliseconds of the same matmul first
    matmul = 2 * m * n * k / _best_seconds(device, 5, lambda: a @ b.T, warm=_MATMUL_WARM_CALLS)
    return PrefillRates(link, matmul)


def token_seconds(config: ModelConfig, rates: PrefillRates) -> float:
    """A MoE layer's prefill time a token, estimated from its routed experts' FLOPs (gate, up and down of
    every routed pair) at the measured matmul rate."""
    flops = 2 * 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts_per_tok
    return PREFILL_OVER_EXPERT_MATMUL * flops / rates.matmul


def chunk_tokens(step: int, link_seconds: float, seconds_a_token: float, most: int) -> int:
    """The shortest multiple of `step` tokens whose math (`seconds_a_token` each) covers `link_seconds`, at least
    `step` and at most `most` (a multiple of `step` or `step` itself)."""
    need = math.ceil(link_seconds / seconds_a_token / step) * step if seconds_a_token > 0 else step
    return max(step, min(need, most))


def most_chunk_tokens(step: int, room: int, token_reserve: int, max_model_len: int) -> int:
    """The longest chunk, in multiples of `step`, whose reserve beyond a `step`-token one takes at most
    MOST_RESERVE_SHARE of `room` (device bytes for routed experts), and no longer than max_model_len."""
    extra = int(MOST_RESERVE_SHARE * room) // max(token_reserve, 1)
    return max(step, min(step + extra, max_model_len) // step * step)


def log_choice(tokens: int, hosted: int, link_seconds: float, seconds_a_token: float, most: int,
               rates: PrefillRates) -> None:
    log.info("event=prefill_chunk tokens=%d host_experts_per_layer=%d link_gb_s=%.1f matmul_tflops=%.0f "
             "link_ms_per_layer=%.1f math_ms_per_layer=%.1f most_tokens=%d", tokens, hosted, rates.link / 1e9,
             rates.matmul / 1e12, link_seconds * 1e3, seconds_a_token * tokens * 1e3, most)
