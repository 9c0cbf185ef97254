"""Where each routed expert lives: a fixed number of device slots per MoE layer, filled hottest first.

The budget is split evenly over the MoE layers (every layer runs once per token, so a layer with
fewer slots would be the bottleneck of every step); within a layer the experts routed most often
(online counts, or a calibration run's) take the slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Empty host bank entries per MoE layer beside its hosted experts: a swap copies the outgoing device expert into
# one while the incoming expert is still served from its own entry, so no step waits for a swap's copies.
HOST_SPARES = 1


def spare_entries(hosted: int) -> int:
    """Spare entries of a host bank holding `hosted` experts (none where nothing can move in or out)."""
    return HOST_SPARES if hosted else 0


def slots_per_layer(budget_bytes: int, expert_nbytes: int, num_layers: int, num_experts: int) -> int:
    """How many experts of each MoE layer fit in `budget_bytes` of device memory."""
    if budget_bytes < 0:
        raise ValueError(f"expert VRAM budget must be >= 0 bytes, got {budget_bytes}")
    return min(num_experts, budget_bytes // (expert_nbytes * max(num_layers, 1)))


def hottest(counts: torch.Tensor | None, num_experts: int, slots: int) -> list[int]:
    """The `slots` experts with the highest counts (ties to the lower id); the first ids without counts."""
    if counts is None:
        return list(range(slots))
    values = counts.tolist()  # not one tensor index per expert
    order = sorted(range(num_experts), key=lambda e: (-values[e], e))
    return sorted(order[:slots])


def plan_placement(layers: list[int], num_experts: int, expert_nbytes: int, budget_bytes: int,
                   counts: dict[int, torch.Tensor] | None = None) -> dict[int, list[int]]:
    """layer -> the experts resident on the device (slot i holds the i-th), under the byte budget."""
    slots = slots_per_layer(budget_bytes, expert_nbytes, len(layers), num_experts)
    return {layer: hottest(None if counts is None else counts.get(layer), num_experts, slots) for layer in layers}


AUTO = "auto"  # a budget of whatever device memory is free once the caches are allocated
# Device memory kept beside the weights and caches, sized from the largest step the engine takes (a prefill
# chunk of max_num_batched_tokens): its transient tensors (mHC streams, projections, the routed pairs' gate, up
# and down outputs, the indexer's scores over the context), workspaces, the decode graphs' pool and allocator
# slack. A fixed share of the device (8% before) kept ~11 GiB back on an H200, 8 GiB of it never used: ~11
# expert slots a layer (ops/BENCHMARKS.md).
ACTIVATION_BYTES_PER_TOKEN = 1 << 20  # per token of a step, an upper bound at the release's shapes
SCORE_BYTES_PER_CONTEXT = 4  # per (token of a step, token of its context): the indexer's scores and top-k
BASE_RESERVE = 2 << 30  # workspaces, the decode graphs' pool, allocator slack


def reserve_bytes(max_batched_tokens: int, max_model_len: int) -> int:
    """Device bytes kept back from expert slots for the largest step's transient tensors."""
    return BASE_RESERVE + max_batched_tokens * (ACTIVATION_BYTES_PER_TOKEN + SCORE_BYTES_PER_CONTEXT * max_model_len)


def resolve_budget(requested: int | None, device: torch.device, weight_bytes: int, reserve: int) -> int | str | None:
    """The expert budget to serve with: the one asked for; else, on a GPU the weights do not fit
    (their bytes against free memory less the reserve), AUTO; else None (every weight resident)."""
    if requested is not None or device.type != "cuda":
        return requested
    free, _ = torch.cuda.mem_get_info(device)
    return None if weight_bytes <= free - reserve else AUTO


def auto_budget(free_bytes: int, reserve: int) -> int:
    """Device bytes for expert slots once everything else is allocated: what is free less the reserve."""
    return max(0, free_bytes - reserve)


@dataclass(frozen=True)
class WeightBytes:
    """What a model's weights take in all, and the routed experts' share: enough to place experts before
    any is read."""

    total: int
    experts: int


def plan_load(requested: int | str | None, device: torch.device, sizes: WeightBytes, moe_layers: int,
              num_experts: int, cache_bytes: int, reserve: int) -> tuple[int | str | None, int | None]:
    """(the budget to serve with, routed experts per MoE layer the loaders put on the device; None: every
    expert with the other weights). An automatic budget is the device memory left by the other weights
    and the caches, less the reserve (`reserve_bytes`)."""
    budget = resolve_budget(requested, device, sizes.total + cache_bytes, reserve)
    if budget is None or not moe_layers:
        return budget, None
    budget_bytes = budget
    if budget == AUTO:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        budget_bytes = max(0, auto_budget(free, reserve) - (sizes.total - sizes.experts) - cache_bytes)
    per_expert = max(1, sizes.experts // (moe_layers * num_experts))
    return budget, slots_per_layer(int(budget_bytes), per_expert, moe_layers, num_experts)
