"""The staging slots a decode step's PCIe share of the misses lands in (experts/hybrid.py): `capacity` experts
(or parts of them) copied from the host bank by one device kernel, then run there by the device executor.
A prefill's misses run from a copy of the whole bank instead (offload/bank_prefetch.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.kernels import kernel
from engine.kernels.experts.gather import GatherPlan, gather_plan
from engine.weights import Weight, map_tensors, tensor_fields

Stacks = tuple[Weight, Weight, Weight]


class ExpertFetcher:
    def __init__(self, template: Stacks, capacity: int, device: torch.device, make_executor: Callable) -> None:
        """template: stacks of one layer (every MoE layer has the same formats and expert shapes)."""
        self.capacity = capacity
        # zeros: a split expert's staged part leaves the rest of its down columns as they were, finite
        self.staging = tuple(map_tensors(s, lambda t: torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype,
                                                                    device=device)) for s in template)
        self._plans: dict[tuple, GatherPlan] = {}  # by host bank: what the decode step's gather copies
        self.run = make_executor({0: self.staging})

    def gather(self, host: Stacks, entries: torch.Tensor, parts: torch.Tensor, split_units: int) -> None:
        """Staging slot s <- host expert entries[s] (where >= 0), its first parts[s] of `split_units`
        parts, by one kernel reading the host bank over PCIe with the entries on the device: no host decision,
        so it can sit in a captured graph."""
        kernel("gather_experts", entries.device.type)(self.plan(host, split_units), entries, parts)

    def plan(self, host: Stacks, split_units: int) -> GatherPlan:
        """What `gather` copies from this host bank (built at the first call: make it before a graph capture)."""
        key = (host[0].shape, *(getattr(host[0], name).data_ptr() for name in tensor_fields(host[0])))
        if key not in self._plans:
            self._plans[key] = gather_plan(self.staging, host, split_units)
        return self._plans[key]
