"""The swap policy alone, on the CPU: hit rate, swaps per step and the host's time per rebalance, under a routing
trace drawn from a Zipf-like distribution per layer (skew 0: uniform), next to the ideal hit rate (the slots
holding each layer's hottest experts). Experts are tiny: what is measured is the policy and its bookkeeping,
not copies.

    python -m ops.sim_swaps --slots 197 --skew 1 --batch 1 [--layers 8] [--steps 600] [--z 2] [--decay 0.99]
"""

from __future__ import annotations

import argparse
import time

import torch

import engine.experts.hybrid as hybrid_module
from engine.experts.hybrid import HybridExperts
from engine.weights import DenseWeight

EXPERTS, TOPK = 288, 8


def routing_probs(layers: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """[layers, EXPERTS]: p(expert) ~ 1 / rank^skew, ranks shuffled per layer."""
    weights = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** skew
    return torch.stack([weights[torch.randperm(EXPERTS, generator=gen)] for _ in range(layers)])


def simulate(layers: int, slots: int, skew: float, batch: int, steps: int, max_swaps: int,
             decay: float | None = None) -> dict:
    """Route `steps` steps, rebalancing after each; figures over the second half (placement settled)."""
    gen = torch.Generator().manual_seed(1)
    stack = lambda n, k: DenseWeight(torch.randn(EXPERTS, n, k, generator=gen))  # noqa: E731
    hybrid = HybridExperts.place({layer: (stack(2, 4), stack(2, 4), stack(4, 2)) for layer in range(layers)},
                                 {layer: list(range(slots)) for layer in range(layers)}, torch.device("cpu"), 7.0)
    hybrid.decay = hybrid.decay if decay is None else decay
    probs = routing_probs(layers, skew, gen)
    ideal = probs.sort(1, descending=True).values[:, :slots].sum(1) / probs.sum(1)
    hits = pairs = moves = 0
    seconds = 0.0
    for step in range(steps):
        for index in range(layers):
            ids = torch.multinomial(probs[index].expand(batch, -1), TOPK, generator=gen).flatten()
            hybrid.counts[index].index_add_(0, ids, torch.ones(ids.numel()))
            if step >= steps // 2:
                hits, pairs = hits + int((hybrid.slot_of[index][ids] >= 0).sum()), pairs + ids.numel()
        start = time.perf_counter()
        made = hybrid.rebalance(max_swaps)
        seconds += time.perf_counter() - start
        moves += made if step >= steps // 2 else 0
    return {"hit_rate": round(hits / pairs, 4), "ideal_hit_rate": round(float(ideal.mean()), 4),
            "swaps_per_step": round(moves / (steps - steps // 2), 3), "rebalance_ms": round(seconds / steps * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=197, help="device slots per MoE layer")
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--max-swaps", type=int, default=4)
    parser.add_argument("--z", type=float, help="override SWAP_Z (the significance a swap needs)")
    parser.add_argument("--decay", type=float, help="override the routing counts' decay per step")
    args = parser.parse_args()
    if args.z is not None:
        hybrid_module.SWAP_Z = args.z
    figures = simulate(args.layers, args.slots, args.skew, args.batch, args.steps, args.max_swaps, args.decay)
    print(" ".join(f"{k}={v}" for k, v in {**vars(args), "z": hybrid_module.SWAP_Z, **figures}.items()))


if __name__ == "__main__":
    main()
