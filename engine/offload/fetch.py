"""Missed experts fetched into device memory for large batches (prefill).

A prefill chunk routes thousands of (token, expert) pairs to experts that live in host RAM: the CPU
would spend seconds on that math where the GPU spends milliseconds, so the experts come to the GPU
instead, in rounds of `capacity` experts. Two staging stacks take turns: while the device runs one
round's experts from one stack, a copy stream fills the other with the next round's (from pinned host
memory), so the link and the math overlap; events order each stack's reuse. The first stack is also
where a decode step's PCIe share of the misses lands (experts/hybrid.py), between fetches on the same
stream.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.kernels import kernel
from engine.kernels.experts.gather import GatherPlan, gather_plan
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
        # zeros: a split expert's staged part leaves the rest of its down columns as they were, finite
        self.buffers = [tuple(map_tensors(s, lambda t: torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype,
                                                                      device=device)) for s in template)
                        for _ in range(2)]
        self._plans: dict[tuple, GatherPlan] = {}  # by host bank: what the decode step's gather copies
        self.runs = [make_executor({0: stacks}) for stacks in self.buffers]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def staging(self) -> Stacks:
        """The first staging stack (the decode step's PCIe share uses it)."""
        return self.buffers[0]

    @property
    def run(self) -> Callable:
        return self.runs[0]

    def gather(self, host: Stacks, entries: torch.Tensor, parts: torch.Tensor, split_units: int) -> None:
        """First staging stack slot s <- host expert entries[s] (where >= 0), its first parts[s] of `split_units`
        parts, by one kernel reading the host bank over PCIe with the entries on the device: no host decision,
        so it can sit in a captured graph."""
        kernel("gather_experts", entries.device.type)(self.plan(host, split_units), entries, parts)

    def plan(self, host: Stacks, split_units: int) -> GatherPlan:
        """What `gather` copies from this host bank (built at the first call: make it before a graph capture)."""
        key = (host[0].shape, *(getattr(host[0], name).data_ptr() for name in tensor_fields(host[0])))
        if key not in self._plans:
            self._plans[key] = gather_plan(self.staging, host, split_units)
        return self._plans[key]

    def __call__(self, host: Stacks, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Pairs (x row, expert id in `host`, routing weight), one per entry of rows/ids/weights
        -> [len(rows), D]."""
        out = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        experts = ids.unique().tolist()
        rounds = [experts[start:start + self.capacity] for start in range(0, len(experts), self.capacity)]
        compute = torch.cuda.current_stream(x.device) if self.copy_stream is not None else None
        if compute is not None:
            self.copy_stream.wait_stream(compute)  # the stacks' earlier readers come first
        freed: list[torch.cuda.Event | None] = [None, None]  # the compute that last read each stack
        ready = self._load(host, rounds, 0, freed)
        for index, chosen in enumerate(rounds):
            following = self._load(host, rounds, index + 1, freed)  # queued before this round's math
            if ready is not None:
                compute.wait_event(ready)
            slot_of = torch.full((host[0].shape[0],), -1, dtype=torch.long, device=ids.device)
            slot_of[torch.tensor(chosen, device=ids.device)] = torch.arange(len(chosen), device=ids.device)
            slots = slot_of[ids]
            picked = (slots >= 0).nonzero().squeeze(1)
            out[picked] = self.runs[index % 2](0, x[rows[picked]], slots[picked].unsqueeze(1),
                                               weights[picked].unsqueeze(1))
            if compute is not None:
                freed[index % 2] = compute.record_event()
            ready = following
        return out

    def _load(self, host: Stacks, rounds: list[list[int]], index: int,
              freed: list[torch.cuda.Event | None]) -> torch.cuda.Event | None:
        """Queue round `index`'s experts into its stack (on the copy stream, after the stack's last reader)
        -> the event the round's math waits for (None: copied already, or no such round)."""
        if index >= len(rounds):
            return None
        stacks = self.buffers[index % 2]
        if self.copy_stream is None:
            for slot, expert in enumerate(rounds[index]):
                copy_expert(stacks, slot, host, expert)
            return None
        if freed[index % 2] is not None:
            self.copy_stream.wait_event(freed[index % 2])
        with torch.cuda.stream(self.copy_stream):
            for slot, expert in enumerate(rounds[index]):
                copy_expert(stacks, slot, host, expert)
            return self.copy_stream.record_event()
