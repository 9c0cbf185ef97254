"""Routed experts split between device slots and host RAM (hybrid offload).

Every MoE layer keeps a few experts in device slots (compact stacks the device executor runs) and all
of them in a host bank (pinned when a GPU is present). A step's (token, expert) pairs that hit a slot
run on the device, with misses weighted zero so the launch shape never depends on routing; the
misses run on the CPU executor over the host bank at the same time, and their sum is added back;
a batch with many misses (prefill) fetches those experts to the device instead (offload/fetch.py).
Routing counts decide, between steps, which host experts move into which slots (a bounded number
per step, so no step waits on many copies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.checkpoint.layout import EXPERT_PROJS, stacked_expert_name
from engine.experts.cpu_experts import CpuExperts
from engine.experts.torch_experts import TorchExperts
from engine.offload.fetch import ExpertFetcher, Stacks, copy_expert
from engine.offload.placement import hottest, plan_placement
from engine.weights import map_tensors


@dataclass
class OffloadStats:
    """Totals since start: pairs that ran on the device and on the CPU, expert swaps, CPU executor time."""

    device_pairs: int = 0
    host_pairs: int = 0
    fetched_pairs: int = 0  # misses of large batches, run on the device after a copy of their experts
    fetched_bytes: int = 0
    swaps: int = 0
    host_seconds: float = 0.0
    host_bytes: int = 0  # expert bytes the CPU executor read

    @property
    def hit_rate(self) -> float:
        """Pairs whose expert was already in a device slot, of all pairs."""
        total = self.device_pairs + self.host_pairs + self.fetched_pairs
        return self.device_pairs / total if total else 1.0


def expert_nbytes(stacks: Stacks) -> int:
    """Bytes of one expert (gate, up and down) in a layer's stacks."""
    return sum(s.nbytes() for s in stacks) // stacks[0].shape[0]


class HybridExperts:
    def __init__(self, host: dict[int, Stacks], placement: dict[int, list[int]], device: torch.device,
                 swiglu_limit: float, device_executor=TorchExperts, count_decay: float = 0.99,
                 host_threads: int | None = None, fetch_min_pairs: int = 256, fetch_capacity: int = 16) -> None:
        self.host, self.device, self.decay = host, device, count_decay
        self.layers = sorted(host)
        self.num_experts = host[self.layers[0]][0].shape[0]
        self.resident = {layer: list(placement[layer]) for layer in self.layers}  # slot -> expert
        self.slot_of = torch.full((len(self.layers), self.num_experts), -1, dtype=torch.long, device=device)
        self.counts = torch.zeros(len(self.layers), self.num_experts, device=device)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        stacks = {}
        for layer, experts in self.resident.items():
            if experts:
                self.slot_of[self._index[layer], experts] = torch.arange(len(experts), device=device)
                picked = torch.tensor(experts)
                stacks[layer] = tuple(map_tensors(s, lambda t: t[picked].to(device)) for s in host[layer])
        self.device_stacks = stacks  # layers with no slot are absent: every pair there runs on the host
        self.device_run = device_executor(stacks, swiglu_limit)
        self.host_run = CpuExperts(host, swiglu_limit, host_threads)
        # Batches with at least this many missed pairs fetch those experts instead (prefill).
        self.fetch_min_pairs = fetch_min_pairs
        self.fetch = ExpertFetcher(host[self.layers[0]], min(fetch_capacity, self.num_experts), device,
                                   lambda stacks: device_executor(stacks, swiglu_limit))
        self.expert_bytes = expert_nbytes(host[self.layers[0]])
        self.stats = OffloadStats()

    @classmethod
    def from_weights(cls, w: dict, layers: list[int], swiglu_limit: float, device: torch.device, budget_bytes: int,
                     device_executor=TorchExperts, host_threads: int | None = None) -> "HybridExperts":
        """Takes the expert stacks out of `w` into the host bank (pinned with a GPU) and fills the slots."""
        pin = device.type == "cuda"
        host = {}
        for layer in layers:
            names = [stacked_expert_name(layer, p) for p in EXPERT_PROJS]
            host[layer] = tuple(map_tensors(w.pop(n), lambda t: _to_host(t, pin)) for n in names)
        first = host[layers[0]]
        placement = plan_placement(layers, first[0].shape[0], expert_nbytes(first), budget_bytes)
        return cls(host, placement, device, swiglu_limit, device_executor, host_threads=host_threads)

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        index = self._index[layer]
        self.counts[index] += torch.bincount(expert_ids.flatten(), minlength=self.num_experts).float()
        slots = self.slot_of[index][expert_ids]
        hit = slots >= 0
        # Find the misses and bring their rows to the host before the device work is queued, so the
        # CPU computes while the device runs its experts.
        missed = (~hit).flatten().nonzero().squeeze(1)
        rows = missed // expert_ids.shape[1]
        fetch = missed.numel() >= self.fetch_min_pairs
        host_in = None
        if missed.numel() and not fetch:
            host_in = x[rows].cpu(), expert_ids.flatten()[missed].cpu(), weights.flatten()[missed].cpu()
        if layer in self.device_stacks:
            out = self.device_run(layer, x, slots.clamp(min=0), weights * hit)
        else:
            out = torch.zeros_like(x)
        self.stats.device_pairs += expert_ids.numel() - missed.numel()
        if fetch:
            ids = expert_ids.flatten()[missed]
            out.index_add_(0, rows, self.fetch(self.host[layer], x, rows, ids, weights.flatten()[missed]))
            self.stats.fetched_pairs += missed.numel()
            self.stats.fetched_bytes += int(ids.unique().numel()) * self.expert_bytes
        elif host_in is not None:
            out.index_add_(0, rows, self._host(layer, *host_in).to(x.device, non_blocking=True))
        return out

    def _host(self, layer: int, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One row per missed pair: each runs its one expert on the CPU -> [P, D]."""
        start = time.perf_counter()
        y = self.host_run(layer, rows, ids.unsqueeze(1), weights.unsqueeze(1))
        self.stats.host_seconds += time.perf_counter() - start
        self.stats.host_pairs += ids.numel()
        self.stats.host_bytes += int(ids.unique().numel()) * self.expert_bytes
        return y

    def rebalance(self, max_swaps: int) -> int:
        """Move up to `max_swaps` experts routed more often than a resident one into its slot; -> swaps made."""
        counts = self.counts.cpu()
        self.counts *= self.decay
        made = 0
        for layer in self.layers:
            experts = self.resident[layer]
            if not experts or made >= max_swaps:
                continue
            c = counts[self._index[layer]]
            wanted = set(hottest(c, self.num_experts, len(experts)))
            incoming = sorted(wanted - set(experts), key=lambda e: -float(c[e]))
            outgoing = sorted(set(experts) - wanted, key=lambda e: float(c[e]))
            for new, old in zip(incoming, outgoing):
                if made >= max_swaps or c[new] <= c[old]:
                    break
                self._swap(layer, experts.index(old), new)
                made += 1
        self.stats.swaps += made
        return made

    def _swap(self, layer: int, slot: int, expert: int) -> None:
        """Copy a host expert into a device slot and repoint the routing map."""
        copy_expert(self.device_stacks[layer], slot, self.host[layer], expert)
        index = self._index[layer]
        self.slot_of[index, self.resident[layer][slot]] = -1
        self.slot_of[index, expert] = slot
        self.resident[layer][slot] = expert

def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = t.to("cpu")
    return host.pin_memory() if pin else host
