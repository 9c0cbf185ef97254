"""Where each routed expert lives: a fixed number of device slots per MoE layer, filled hottest first.

The budget (engine/memory_plan.py) is split evenly over the MoE layers (every layer runs once per token, so
a layer with fewer slots would be the bottleneck of every step); within a layer the experts routed most
often (online counts, or a calibration run's) take the slots.
"""

from __future__ import annotations

import torch

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
