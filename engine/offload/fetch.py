"""Missed experts fetched into device memory for large batches (prefill).

A prefill chunk routes thousands of (token, expert) pairs to experts that live in host RAM: the CPU
would spend seconds on that math where the GPU spends milliseconds, so the experts come to the GPU
instead, in rounds of `capacity` experts through one staging stack. The copies (from pinned memory)
and the math are queued on the same stream, so a round never reads a half-copied expert; overlapping
the next round's copy with this round's math (a second buffer on a copy stream) is the next step.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.weights import Weight, map_tensors, tensor_fields

Stacks = tuple[Weight, Weight, Weight]


def copy_expert(dst: Stacks, slot: int, src: Stacks, expert: int) -> None:
    """dst[·][slot] = src[·][expert] for gate, up and down (asynchronously from pinned host memory)."""
    for dst_stack, src_stack in zip(dst, src):
        for name in tensor_fields(dst_stack):
            getattr(dst_stack, name)[slot].copy_(getattr(src_stack, name)[expert], non_blocking=True)


class ExpertFetcher:
    def __init__(self, template: Stacks, capacity: int, device: torch.device, make_executor: Callable) -> None:
        """template: stacks of one layer (every MoE layer has the same formats and expert shapes)."""
        self.capacity = capacity
        self.staging = tuple(map_tensors(s, lambda t: torch.empty((capacity, *t.shape[1:]), dtype=t.dtype,
                                                                     device=device)) for s in template)
        self.run = make_executor({0: self.staging})

    def __call__(self, host: Stacks, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Pairs (x row, expert id in `host`, routing weight), one per entry of rows/ids/weights
        -> [len(rows), D]."""
        out = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        experts = ids.unique().tolist()
        for start in range(0, len(experts), self.capacity):
            chosen = experts[start:start + self.capacity]
            for slot, expert in enumerate(chosen):
                copy_expert(self.staging, slot, host, expert)
            slot_of = torch.full((host[0].shape[0],), -1, dtype=torch.long, device=ids.device)
            slot_of[torch.tensor(chosen, device=ids.device)] = torch.arange(len(chosen), device=ids.device)
            slots = slot_of[ids]
            picked = (slots >= 0).nonzero().squeeze(1)
            out[picked] = self.run(0, x[rows[picked]], slots[picked].unsqueeze(1), weights[picked].unsqueeze(1))
        return out
