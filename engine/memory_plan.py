"""Where the device's memory goes, decided once before the load: the request slots and latent pages, the
prefix cache's tiers, the reserve for the largest step, and the routed experts' share (bytes and slots
per MoE layer, and the host banks' spare entries). The server and the offline `LLM` call `plan_memory`;
the loaders take its slots, the engine its sizes, and nothing measures the device's free memory again.

Experts get what the rest leaves: every MoE layer runs once per token, so the budget is split evenly over
the layers (`engine/offload/placement.py` decides which experts fill a layer's slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.cache.prefix_cache import TierSize
from engine.cache.state_rows import page_bytes, state_bytes
from engine.config import ModelConfig
from engine.model.mtp import with_mtp_cache
from engine.options import EngineOptions
from engine.offload.placement import slots_per_layer
from engine.prefill_chunk import PrefillRates, chunk_tokens, log_choice, most_chunk_tokens, token_seconds

log = logging.getLogger("glmflash.engine")

AUTO = "auto"  # an expert budget of whatever device memory the other weights and the caches leave
# Device memory kept beside the weights and caches, sized from the largest step the engine takes (a prefill
# chunk of max_num_batched_tokens, or of max_prefill_tokens where larger): its transient tensors (mHC streams,
# projections, the routed pairs' gate, up and down outputs, the indexer's scores over the context), workspaces,
# the decode graphs' pool and allocator slack. A fixed share of the device (8% before) kept ~11 GiB back on an
# H200, 8 GiB of it never used: ~11 expert slots a layer (ops/BENCHMARKS.md).
ACTIVATION_BYTES_PER_TOKEN = 1 << 20  # per token of a step, an upper bound at the release's shapes
SCORE_BYTES_PER_CONTEXT = 4  # per (token of a step, token of its context): the indexer's scores and top-k
BASE_RESERVE = 2 << 30  # workspaces, the decode graphs' pool, allocator slack


@dataclass(frozen=True)
class WeightBytes:
    """What a model's weights take in all, and the share of the routed experts the placement splits between
    the device and host RAM: enough to place experts before any is read."""

    total: int  # every weight the load brings
    experts: int  # the placed routed experts' bytes (stacks that stay whole on the device count in `total` only)
    expert_layers: int  # the MoE layers those experts are in: the model's, and the MTP layer's where it is loaded
    # and stored in their format


@dataclass(frozen=True)
class MemoryPlan:
    request_pages: int  # latent pages the request slots reserve: every slot at max_model_len
    prefix_device: TierSize  # the prefix cache's snapshots and extra pages on the device
    prefix_host: TierSize  # and in host RAM (evicted from the device)
    cache_bytes: int  # device bytes of the slots, all latent pages and the device snapshots
    reserve_bytes: int  # device bytes kept for the largest step's transient tensors
    expert_budget: int | None  # device bytes for routed experts; None: every expert resident
    expert_slots: int | None  # routed experts per MoE layer the loaders put on the device; None: all, or the
    # weights are in memory already (the engine places them under expert_budget)
    context_token_bytes: int = 0  # latent cache bytes a token of context takes (every DSA layer's)
    most_context_tokens: int | None = None  # tokens of context (all requests together) the device's free memory
    # holds beside the other weights, the reserve and the KDA slots, every routed expert in host RAM; None: not
    # measured (a CPU)
    prefill_tokens: int | None = None  # tokens of a step of prompts alone: the options', or under hybrid offload
    # chosen from the link's rate and the free memory (engine/prefill_chunk.py); None: max_num_batched_tokens

    @property
    def latent_pages(self) -> int:
        return self.request_pages + self.prefix_device.pages


# Empty host bank entries per MoE layer beside its hosted experts: a swap copies the outgoing device expert into
# one while the incoming expert is still served from its own entry, so no step waits for a swap's copies.
HOST_SPARES = 1


def spare_entries(hosted: int) -> int:
    """Spare entries of a host bank holding `hosted` experts (none where nothing can move in or out)."""
    return HOST_SPARES if hosted else 0


def slots_beside_bank(slots: int, budget: int, per_expert: int, layers: int, experts: int) -> int:
    """The most expert slots a layer, up to `slots`, that leave room in `budget` for the device's copy of one
    layer's host bank (what a prefill-sized batch runs its missed experts from: offload/bank_prefetch.py). An
    explicit budget is the slots' alone, the bank's copy beside it."""
    def fits(s: int) -> bool:
        return (s * layers + experts - s + spare_entries(experts - s)) * per_expert <= budget

    while slots and not fits(slots):
        slots -= 1
    return slots


def reserve_bytes(max_batched_tokens: int, max_model_len: int) -> int:
    """Device bytes kept back from expert slots for the largest step's transient tensors."""
    return BASE_RESERVE + max_batched_tokens * (ACTIVATION_BYTES_PER_TOKEN + SCORE_BYTES_PER_CONTEXT * max_model_len)


def cache_config(config: ModelConfig, options: EngineOptions) -> ModelConfig:
    """The layers the caches hold: the model's, and the MTP layer's DSA where drafts are asked of a config that
    declares one (a checkpoint that lacks it, such as the ModelOpt build, leaves that index unused)."""
    return with_mtp_cache(config) if options.drafts_on and config.num_mtp_layers else config


def build_caches(config: ModelConfig, options: EngineOptions, plan: MemoryPlan, device: torch.device,
                 dtype: torch.dtype) -> tuple[RequestSlots, PagedLatents]:
    """The request slots and the latent pages (the requests' and the prefix cache's device pages) the plan sized."""
    held = cache_config(config, options)
    return (RequestSlots(held, options.max_num_seqs, device, dtype),
            PagedLatents(held, plan.latent_pages, options.page_size, device, dtype, options.fp8_latents))


def plan_memory(config: ModelConfig, options: EngineOptions, device: torch.device, dtype: torch.dtype,
                weights: WeightBytes | None = None, free_bytes: int | None = None,
                measure_rates: Callable[[], PrefillRates | None] | None = None) -> MemoryPlan:
    """The plan for these options. `weights`: what a load will bring (None: the weights are in memory already,
    and `free_bytes` what they left). `free_bytes`: the device's free memory now (measured on CUDA when not
    given; none on the CPU). `measure_rates()`: the link's and the matmul's (`measured_prefill_rates`), from
    which the prefill chunk is chosen; called only where the options leave it open and experts stay in host RAM."""
    request_pages = options.max_num_seqs * -(-options.max_model_len // options.page_size)

    held = cache_config(config, options)

    def tier(budget: int) -> TierSize:
        return TierSize.of(budget, held, options.page_size, dtype, request_pages, options.fp8_latents) \
            if options.prefix_cache else TierSize(0, 0)

    prefix_device, prefix_host = tier(options.prefix_cache_bytes), tier(options.prefix_cache_host_bytes)
    plan = MemoryPlan(request_pages, prefix_device, prefix_host, 0, 0, None, None)
    meta = build_caches(config, options, plan, torch.device("meta"), dtype)
    caches = prefix_device.snapshots * state_bytes(held, options.page_size, dtype, options.fp8_latents) + sum(
        t.numel() * t.element_size() for cache in meta for t in vars(cache).values() if isinstance(t, torch.Tensor))
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    per_expert = 0 if weights is None else \
        max(1, weights.experts // (max(weights.expert_layers, 1) * config.n_routed_experts))

    def placement(reserve: int) -> tuple[int | None, int | None]:
        """(device bytes, slots a layer) of routed experts beside a `reserve`."""
        budget = _expert_budget(options.moe_vram_budget, device, weights, caches, reserve, free_bytes) \
            if config.moe_layers else None
        if budget is None or weights is None:
            return budget, None
        slots = slots_per_layer(budget, per_expert, weights.expert_layers, config.n_routed_experts)
        if options.moe_vram_budget in (None, AUTO):  # what the device leaves: the bank's copy comes out of it too
            slots = slots_beside_bank(slots, budget, per_expert, weights.expert_layers, config.n_routed_experts)
        return budget, slots

    reserve = reserve_bytes(options.largest_step, options.max_model_len)
    budget, slots = placement(reserve)
    prefill_tokens = options.max_prefill_tokens
    hosting = slots is not None and slots < config.n_routed_experts
    rates = measure_rates() if prefill_tokens is None and hosting and measure_rates is not None else None
    if rates is not None:
        room = _expert_budget(AUTO, device, weights, caches, reserve, free_bytes)  # what experts could have
        prefill_tokens = _prefill_chunk(config, options, rates, room, config.n_routed_experts - slots, per_expert)
        if prefill_tokens > options.largest_step:
            reserve = reserve_bytes(prefill_tokens, options.max_model_len)
            budget, slots = placement(reserve)
    token_bytes = page_bytes(held, options.page_size, dtype, options.fp8_latents) // options.page_size
    most_tokens = _most_context_tokens(plan.latent_pages * options.page_size, token_bytes, caches, reserve, weights,
                                       free_bytes)
    plan = MemoryPlan(request_pages, prefix_device, prefix_host, caches, reserve, budget, slots, token_bytes,
                      most_tokens, prefill_tokens)
    log.info("event=memory_plan free_gib=%.2f cache_gib=%.2f reserve_gib=%.2f expert_budget_gib=%s "
             "expert_slots_per_layer=%s prefix_snapshots=%d prefix_pages=%d kv_cache_dtype=%s context_token_bytes=%d "
             "most_context_tokens=%s prefill_tokens=%s", free_bytes / 2 ** 30, caches / 2 ** 30, reserve / 2 ** 30,
             "none" if budget is None else f"{budget / 2 ** 30:.2f}", "all" if slots is None else slots,
             prefix_device.snapshots, prefix_device.pages, options.kv_cache_dtype, token_bytes,
             "unmeasured" if most_tokens is None else most_tokens, prefill_tokens or options.max_num_batched_tokens)
    short = most_tokens is not None and plan.latent_pages * options.page_size > most_tokens
    if short and weights is None:  # placed already: the weights' placement decided what is left, nothing to refuse
        log.warning("event=memory_plan_short latent_tokens=%d most_context_tokens=%d reserve_gib=%.2f",
                    plan.latent_pages * options.page_size, most_tokens, reserve / 2 ** 30)
    elif short:
        raise ValueError(f"max_model_len {options.max_model_len} x max_num_seqs {options.max_num_seqs} tokens of "
                         f"context (and {prefix_device.pages * options.page_size} for the prefix cache) do not fit "
                         f"the device: {free_bytes / 2 ** 30:.1f} GiB free holds at most {most_tokens} ({token_bytes} "
                         f"bytes a token with kv_cache_dtype={options.kv_cache_dtype}"
                         f"{'' if options.fp8_latents else '; fp8 takes about half'}) beside the other weights")
    return plan


def _prefill_chunk(config: ModelConfig, options: EngineOptions, rates: PrefillRates, room: int, hosted: int,
                   per_expert: int) -> int:
    """Tokens of a step of prompts alone under hybrid offload, `hosted` experts a layer in host RAM, `room` the
    device bytes an automatic expert budget would have beside a decode step's reserve (engine/prefill_chunk.py)."""
    step = options.max_num_batched_tokens
    link = hosted * per_expert / rates.link
    seconds = token_seconds(config, rates)
    most = most_chunk_tokens(step, room, reserve_bytes(1, options.max_model_len) - BASE_RESERVE,
                             options.max_model_len)
    tokens = chunk_tokens(step, link, seconds, most)
    log_choice(tokens, hosted, link, seconds, most, rates)
    return tokens


def _most_context_tokens(cached_tokens: int, token_bytes: int, caches: int, reserve: int,
                         weights: WeightBytes | None, free: int) -> int | None:
    """Tokens of latent cache the free memory holds once the non-expert weights, the reserve and the caches other
    than the latent pages (`cached_tokens` of them) are placed; None where there is no device measure."""
    if not free:
        return None
    others = 0 if weights is None else weights.total - weights.experts
    return max(0, free - reserve - others - (caches - cached_tokens * token_bytes)) // token_bytes


def _expert_budget(requested: int | str | None, device: torch.device, weights: WeightBytes | None, caches: int,
                   reserve: int, free: int) -> int | None:
    """Device bytes for routed experts: the ones asked for; with AUTO, or on a GPU the weights do not fit (their
    bytes and the caches' against free memory less the reserve), what the other weights and the caches leave
    of the free memory, less the reserve; else None (every expert resident)."""
    if requested is None:
        if device.type != "cuda" or weights is None or weights.total + caches <= free - reserve:
            return None
        requested = AUTO
    if requested != AUTO:
        if requested < 0:
            raise ValueError(f"expert VRAM budget must be >= 0 bytes, got {requested}")
        return requested
    others = 0 if weights is None else weights.total - weights.experts
    return max(0, free - reserve - others - caches)
