"""Routed experts split between device slots and host RAM (hybrid offload).

Every MoE layer keeps some experts in device slots (compact stacks the device executor runs) and the
rest in a host bank (pinned when a GPU is present). A step's (token, expert) pairs that hit a slot
run on the device, with misses weighted zero so the launch shape never depends on routing. Of a
decode-sized batch's misses, a share (`pcie_percent`, from the two rates measured at start) is copied
over PCIe into staging slots by a device kernel and run there, the rest runs on CPU threads over the
host bank (offload/host_steps.py: queued in the device stream); all three at once, with no device
synchronization, so the step can be captured in a CUDA graph. A batch with many misses (prefill) runs them on
the device from a copy of the layer's whole host bank, the next layer's copy queued behind this layer's math
(offload/bank_prefetch.py).
Routing counts decide, between steps, which host experts move into which slots (a bounded number
per step; offload/swap_policy.py). A move's copies run on copy streams beside the steps, which read both
experts where they were until a later call commits it (one device-to-device copy): no step waits on a swap.
The PCIe share follows the CPU's rate inside the steps (offload/split_follower.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.checkpoint.layout import EXPERT_PROJS, stacked_expert_name
from engine.experts.cpu_experts import CpuExperts
from engine.experts.torch_experts import TorchExperts
from engine.kernels import kernel
from engine.kernels.experts import DECODE_MAX_PAIRS
from engine.kernels.experts.cpu_gemv import available as cpu_kernels_built, pin_workers
from engine.kernels.experts.hybrid_pairs import place_pairs_torch
from engine.kernels.experts.pcie_pick import split_units
from engine.cpu_cores import usable_cores, worker_cpus
from engine.offload.cuda_driver import copy_async
from engine.offload.bank_prefetch import BankPrefetch
from engine.offload.fetch import ExpertFetcher, Stacks
from engine.offload.host_memory import host_copy
from engine.offload.host_steps import HostSteps, HostStepTotals, PendingSum
from engine.memory_plan import spare_entries
from engine.offload.placement import slots_per_layer
from engine.offload.split_follower import HostTotals, SplitFollower
from engine.offload.swap_policy import COUNT_DECAY, SWAP_MARGIN, SWAP_Z, Move, SwapPolicy
from engine.weights import SplitStack, map_tensors, tensor_fields

log = logging.getLogger("glmflash.engine")


@dataclass
class OffloadStats:
    """Totals since start: pairs that ran on the device and on the CPU, expert swaps, CPU executor time."""

    device_pairs: int = 0
    host_pairs: int = 0  # pairs the CPU ran, whole or its part of a split expert
    fetched_pairs: int = 0  # misses run on the device after a copy of their experts (PCIe share, prefill)
    fetched_bytes: int = 0
    swaps: int = 0
    host_seconds: float = 0.0
    host_bytes: int = 0  # expert bytes the CPU executor read
    pcie_percent: int = 0  # share of decode misses sent over PCIe (from the rates, following the CPU's in steps)
    cpu_rate_at_load: float = 0.0  # bytes/s the CPU pass and the PCIe gather reached when measured at load
    pcie_rate_at_load: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Pairs whose expert was already in a device slot, of all pairs."""
        total = self.device_pairs + self.host_pairs + self.fetched_pairs
        return self.device_pairs / total if total else 1.0


def expert_nbytes(stacks: Stacks) -> int:
    """Bytes of one expert (gate, up and down) in a layer's stacks."""
    return sum(s.nbytes() for s in stacks) // stacks[0].shape[0]


def default_host_threads(device: torch.device) -> int:
    """With a GPU, every usable core but one: the thread driving the device waits on it while the CPU
    threads spin between layers (with 16 of them on 16 cores a step's CPU pass read 2.6 GB/s, with 15 54
    GB/s, on the H200 host). Without a GPU, torch's thread count (the cores it uses for the rest of the
    model)."""
    if device.type != "cuda":
        return torch.get_num_threads()
    return max(1, usable_cores() - 1)


@dataclass
class LayerExperts:
    """One MoE layer's routed experts as placed: device slot i holds expert `resident[i]`, host bank entry
    j holds expert `hosted[j]` (None: a spare entry, room for a swap's outgoing expert); every expert is in
    exactly one of the two (the host bank holds only what the device does not, so the whole model fits GPU
    + host RAM)."""

    device: Stacks | None  # None: no device slot in this layer
    host: Stacks
    resident: list[int]
    hosted: list[int | None]

    @classmethod
    def split(cls, stacks: Stacks, resident: list[int], device: torch.device) -> "LayerExperts":
        """Whole stacks (anywhere) -> the resident experts copied to `device`, the rest to host RAM."""
        hosted = [e for e in range(stacks[0].shape[0]) if e not in set(resident)]
        pin, spare = device.type == "cuda", spare_entries(len(hosted))
        on_device = tuple(map_tensors(s, lambda t: t[torch.tensor(resident)].to(device)) for s in stacks) \
            if resident else None
        on_host = tuple(map_tensors(s, lambda t: host_copy(t[torch.tensor(hosted, dtype=torch.long)], pin, spare))
                        for s in stacks)
        return cls(on_device, on_host, list(resident), hosted + [None] * spare)


@dataclass
class _Move:
    """A swap under way: the outgoing expert's bytes on their way from its slot to a spare host entry, the
    incoming one's from its host entry to a device staging expert (`copied`: the copies' events; none without
    a GPU, where they are done at once)."""

    layer: int
    slot: int
    incoming: int
    outgoing: int
    entry: int  # the incoming expert's host entry: spare once the move is committed
    spare: int  # the host entry the outgoing expert goes to
    staging: Stacks
    copied: list = field(default_factory=list)

    def copied_all(self) -> bool:
        return all(event.query() for event in self.copied)


class HybridExperts:
    def __init__(self, layers: dict[int, LayerExperts], device: torch.device, swiglu_limit: float,
                 device_executor=TorchExperts, count_decay: float = COUNT_DECAY, host_threads: int | None = None,
                 fetch_min_pairs: int = 256, fetch_capacity: int = 8, pcie_percent: int = 0,
                 pin_host_threads: bool = True) -> None:
        """pcie_percent: the share of a decode step's misses copied to the device and run there (0-100, in parts
        of an expert; the staging slots bound it per layer step; on or off before the first decode step, see
        `split_misses`). pin_host_threads: with
        a GPU, the CPU threads go to one core each where the process's CPU mask allows (`worker_cpus`);
        without one they share the cores with torch and float."""
        self.device = device
        self.layers = sorted(layers)
        first = layers[self.layers[0]]
        self.num_experts = len(first.resident) + sum(e is not None for e in first.hosted)
        self.resident = {layer: layers[layer].resident for layer in self.layers}  # slot -> expert
        self.hosted = {layer: layers[layer].hosted for layer in self.layers}  # host bank entry -> expert
        self.host = {layer: layers[layer].host for layer in self.layers}
        self.device_stacks = {layer: layers[layer].device for layer in self.layers if layers[layer].device}
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.slot_of = torch.full((len(self.layers), self.num_experts), -1, dtype=torch.long, device=device)
        self.entry_of = torch.full((len(self.layers), self.num_experts), -1, dtype=torch.long)  # host bank entry
        for layer in self.layers:
            i = self._index[layer]
            if self.resident[layer]:
                self.slot_of[i, self.resident[layer]] = torch.arange(len(self.resident[layer]), device=device)
            for entry, expert in enumerate(self.hosted[layer]):
                if expert is not None:
                    self.entry_of[i, expert] = entry
        self.entry_on_device = self.entry_of.to(device)  # the same map, for the device's picks of the misses
        self._slot_of_host = self.slot_of.cpu()  # what commits change, then copied to the device whole
        self.pcie_percent = 0
        self._percent_on_device = torch.zeros((), dtype=torch.long, device=device)  # what the device's pick reads
        self._follower = SplitFollower()
        self._live_rows = torch.zeros((), dtype=torch.long, device=device)  # a replayed graph's rows in use
        # The module's SWAP_MARGIN and SWAP_Z, read at construction: ops/sim_swaps.py sets SWAP_Z here.
        self.swap_policy = SwapPolicy(len(self.layers), self.num_experts, device, count_decay, SWAP_MARGIN, SWAP_Z)
        self.device_run = device_executor(self.device_stacks, swiglu_limit)
        self.host_run = CpuExperts(self.host, swiglu_limit, host_threads or default_host_threads(device))
        self._pin_host_threads(pin_host_threads and device.type == "cuda")
        # Batches with at least this many missed pairs run them on the device from a copy of the bank (prefill).
        self.fetch_min_pairs = fetch_min_pairs
        self.fetch = ExpertFetcher(first.device or first.host, min(fetch_capacity, self.num_experts), device,
                                   lambda stacks: device_executor(stacks, swiglu_limit))
        self.bank = BankPrefetch(first.host, max(len(self.hosted[layer]) for layer in self.layers), device,
                                 lambda stacks: device_executor(stacks, swiglu_limit))
        self._next_layer = dict(zip(self.layers, self.layers[1:]))
        # Off while early readiness fills the host banks: a bank copied ahead of its layer's turn could miss
        # experts the fill writes in between (the engine turns it on once the fill is done).
        self.prefetch_banks = True
        self.expert_bytes = expert_nbytes(first.device or first.host)
        self.split_units = split_units((first.device or first.host)[0].shape[-2])  # of a PCIe/CPU split expert
        for layer in self.layers:  # before any graph capture
            self.fetch.plan(self.host[layer], self.split_units)
        # Every layer's host bank in a format the compiled CPU pass takes (fixed by the weights).
        self._host_compiled = all(layer in self.host_run.compiled for layer in self.layers)
        self.rates_at_load: tuple[float, float] = (0.0, 0.0)  # (CPU, PCIe) bytes/s, when measured
        self.host_steps: dict[int, HostSteps] = {}  # by top-k, built at the first decode-sized batch
        self.handshake = "doorbell"  # how the device hands the CPU its share (host_steps.HANDSHAKES)
        self._stats = OffloadStats()
        self.split_misses(pcie_percent)
        self._pin = device.type == "cuda"
        # A move's copies: device-to-host on the first, host-to-device on the second (the link moves both ways
        # at once).
        self._copy_streams = [torch.cuda.Stream(device) for _ in range(2)] if self._pin else []
        self._link_stream = torch.cuda.Stream(device) if self._pin else None  # a decode step's PCIe share
        self._spare = {layer: [j for j, e in enumerate(self.hosted[layer]) if e is None] for layer in self.layers}
        self._moves: list[_Move] = []
        self._staging: list[Stacks] = []  # device experts no move uses: where an incoming expert's copy lands
        # Set while something reads the slots and the host bank by expert id (a prepared snapshot being
        # written from them): swaps would move experts under it.
        self.swaps_held = False
        self.settle_all = False  # the next rebalance moves every expert the counts ask for, not a bounded few

    @classmethod
    def place(cls, stacks: dict[int, Stacks], placement: dict[int, list[int]], device: torch.device,
              swiglu_limit: float, device_executor=TorchExperts, **options) -> "HybridExperts":
        """From whole stacks: `placement` names each layer's resident experts (slot order)."""
        layers = {layer: LayerExperts.split(stacks[layer], placement[layer], device) for layer in stacks}
        return cls(layers, device, swiglu_limit, device_executor, **options)

    @classmethod
    def from_weights(cls, w: dict, layers: list[int], swiglu_limit: float, device: torch.device, budget_bytes: int,
                     device_executor=TorchExperts, host_threads: int | None = None,
                     pin_host_threads: bool = True) -> "HybridExperts":
        """Takes the expert stacks out of `w`. Stacks the loader already split (`SplitStack`) keep their
        placement; whole ones are placed under `budget_bytes`, one layer at a time (each whole stack is
        dropped once split, so host RAM never holds two copies of the experts)."""
        placed: dict[int, LayerExperts] = {}
        slots = None
        for layer in layers:
            stacks = tuple(w.pop(stacked_expert_name(layer, p)) for p in EXPERT_PROJS)
            if isinstance(stacks[0], SplitStack):
                count = stacks[0].slots
                placed[layer] = LayerExperts(tuple(s.device for s in stacks) if count else None,
                                             tuple(s.host for s in stacks), list(range(count)),
                                             list(range(count, stacks[0].shape[0])) + [None] * stacks[0].spare)
                continue
            if slots is None:
                slots = slots_per_layer(budget_bytes, expert_nbytes(stacks), len(layers), stacks[0].shape[0])
            placed[layer] = LayerExperts.split(stacks, list(range(slots)), device)
            del stacks
        return cls(placed, device, swiglu_limit, device_executor, host_threads=host_threads,
                   pin_host_threads=pin_host_threads)

    def _pin_host_threads(self, pin: bool) -> None:
        built = cpu_kernels_built()
        cpus = worker_cpus(self.host_run.threads) if pin and built else []
        if built:  # the pool is the process's: the last engine built decides (unpinned: [])
            pin_workers(cpus)
        log.info("event=cpu_experts threads=%d pinned=%s", self.host_run.threads,
                 ",".join(map(str, cpus)) if cpus else "none")

    def split_misses(self, pcie_percent: int, measured: tuple[float, float] | None = None) -> None:
        """Set the share of decode misses that go over PCIe and the (CPU, PCIe) rates it came from (given: the
        split then follows the CPU's rate inside the steps, `follow_cpu_rate`). Read at run time by the host
        steps and the device's pick, also inside captured graphs; whether the PCIe path runs at all is built
        into them, so a split on or off is set before the first decode step."""
        if not 0 <= pcie_percent <= 100:
            raise ValueError(f"pcie_percent must be within 0..100, got {pcie_percent}")
        if self.host_steps and (pcie_percent == 0) != (self.pcie_percent == 0):
            raise RuntimeError("the PCIe share is turned on or off before decode steps run, not after")
        self.pcie_percent = pcie_percent
        self._percent_on_device.fill_(pcie_percent)
        for steps in self.host_steps.values():
            steps.split(pcie_percent)
        self.rates_at_load = measured or (0.0, 0.0)

    def follow_cpu_rate(self) -> int | None:
        """Called once a step, before it is queued: a step in flight would run its later layers' host steps at a
        new share and their device picks at the old one (pairs run twice or not at all). When the split came
        from measured rates, every FOLLOW_STEPS decode steps it moves towards the share the CPU's rate inside
        them asks for (offload/split_follower.py) -> the new share, or None."""
        if not self.pcie_percent or not self.rates_at_load[1] or not self.host_steps:
            return None
        if not self._follower.due():
            return None
        percent = self._follower.follow(self.pcie_percent, self._host_totals(), self.rates_at_load)
        if percent is not None and percent != self.pcie_percent:
            self.split_misses(percent, self.rates_at_load)
        return percent

    def _host_totals(self) -> HostTotals:
        """(decode steps the host steps ran, seconds the CPU passes took, expert bytes they read) since start."""
        totals = [steps.totals() for steps in self.host_steps.values()]
        nbytes = sum(t.experts_run * self.expert_bytes - self._split_bytes(t) for t in totals)
        return sum(t.steps for t in totals) // len(self.layers), sum(t.seconds for t in totals), nbytes

    def _split_bytes(self, totals: HostStepTotals) -> int:
        """Bytes of the CPU's split experts that the device ran instead."""
        return totals.units_left * self.expert_bytes // self.split_units

    @property
    def graph_safe(self) -> bool:
        """Whether decode steps run without a device synchronization (the CPU's share queued in the stream),
        so they can be captured: every layer's host bank in a format the compiled CPU kernels take."""
        return self._host_compiled and cpu_kernels_built()

    @property
    def stats(self) -> OffloadStats:
        """Totals of the eager path plus those of the queued host steps (which count inside CUDA graphs)."""
        s = dataclasses.replace(self._stats, pcie_percent=self.pcie_percent)
        s.cpu_rate_at_load, s.pcie_rate_at_load = self.rates_at_load
        for steps in self.host_steps.values():
            t = steps.totals()
            s.device_pairs += t.pairs_seen - t.pairs_missed
            s.host_pairs += t.pairs_run
            s.fetched_pairs += t.pairs_missed - t.pairs_run
            split = self._split_bytes(t)
            s.fetched_bytes += (t.pairs_missed - t.pairs_run) * self.expert_bytes + split
            s.host_seconds += t.seconds
            s.host_bytes += t.experts_run * self.expert_bytes - split
        return s

    def use_rows(self, rows: int) -> None:
        """Rows in use in the next replayed decode graph (its padding rows cost no CPU work and no copies)."""
        self._live_rows.fill_(rows)
        for steps in self.host_steps.values():
            steps.use_rows(rows)

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 shared_expert: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The routed sum plus `shared_expert()`, which the device runs while the CPU works on the misses
        (the shared expert is then off the path a layer waits on)."""
        index = self._index[layer]
        # Too few pairs to ever fetch (and few enough for the decode kernels): the CPU takes the misses.
        decode = expert_ids.numel() < self.fetch_min_pairs and expert_ids.numel() <= DECODE_MAX_PAIRS and \
            self.graph_safe
        place = kernel("place_pairs", x.device.type) if decode else place_pairs_torch
        slots, device_weights, miss = place(expert_ids, weights, self.slot_of[index], self.counts[index])
        if decode:
            host_share = self._host_steps(expert_ids.shape[1]).run(layer, x, expert_ids, weights)
            fetched = self._over_pcie(layer, x, expert_ids, weights, miss) if self.pcie_percent else None
            dense = shared_expert() if shared_expert is not None else None
            resident = self._on_device(layer, x, slots, device_weights)
            return kernel("sum_shares", x.device.type)(resident, fetched.wait() if fetched is not None else None,
                                                       host_share.wait(), dense)
        # Find the misses and bring their rows to the host before the device work is queued, so the
        # CPU computes while the device runs its experts.
        missed = miss.flatten().nonzero().squeeze(1)
        rows = missed // expert_ids.shape[1]
        fetch = missed.numel() >= self.fetch_min_pairs
        host_in = None
        if missed.numel() and not fetch:
            entries = self.entry_of[index][expert_ids.flatten()[missed].cpu()]
            host_in = x[rows].cpu(), entries, weights.flatten()[missed].cpu()
        out = self._on_device(layer, x, slots, device_weights)
        # Queued before the CPU's pass, which blocks this thread.
        dense = shared_expert() if shared_expert is not None else None
        self._stats.device_pairs += expert_ids.numel() - missed.numel()
        if fetch:
            entries = self.entry_on_device[index][expert_ids.flatten()[missed]]  # no map copied a call
            out.index_add_(0, rows, self.bank(layer, self.host[layer], x, rows, entries, weights.flatten()[missed]))
            following = self._next_layer.get(layer)
            if following is not None and self.prefetch_banks:  # the same batch reaches it next: its bank too
                self.bank.load(following, self.host[following])
            self._stats.fetched_pairs += missed.numel()
            self._stats.fetched_bytes += len(self.hosted[layer]) * self.expert_bytes
        elif host_in is not None:
            out.index_add_(0, rows, self._host(layer, *host_in).to(x.device, non_blocking=True))
        return out if dense is None else out + dense

    def _on_device(self, layer: int, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The pairs whose experts sit in device slots (`place_pairs`: misses at slot 0, weighted zero, which the
        decode kernels skip) -> [T, D] in x's dtype."""
        if layer not in self.device_stacks:
            return torch.zeros_like(x)
        return self.device_run(layer, x, slots, weights)

    def _over_pcie(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                   miss: torch.Tensor) -> PendingSum:
        """The device's share of the misses: the first pairs whole and a part of the next one's rows, by the rule
        of kernels/experts/pcie_pick.py, while staging slots last (the host step applies the same rule to the
        same ids and runs the rest). Those experts (or parts) are copied into the staging slots by one kernel
        reading the host bank, then run by the device executor -> [T, D] in x's dtype, once waited for. With a
        GPU all of it runs on a stream of its own, beside the resident experts and the shared expert: the copy
        waits on the link, not on them."""
        index = self._index[layer]
        # a replay runs padding rows: copy nothing for them
        live = self._live_rows if x.is_cuda and torch.cuda.is_current_stream_capturing() else None
        if self._link_stream is not None:
            self._link_stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self._link_stream):
            entries, parts, slots, picked_weights = kernel("pcie_pick", x.device.type)(
                expert_ids, weights, miss, self.entry_on_device[index], live, self._percent_on_device,
                self.fetch.capacity, self.split_units)
            self.fetch.gather(self.host[layer], entries, parts, self.split_units)
            return PendingSum(self.fetch.run(0, x, slots, picked_weights), self._link_stream)

    def _host_steps(self, topk: int) -> HostSteps:
        if topk not in self.host_steps:
            cpu_entry = {layer: self.entry_of[self._index[layer]] for layer in self.layers}
            self.host_steps[topk] = HostSteps(self.host_run.compiled, cpu_entry, topk, self.host_run.limit,
                                              self.host_run.threads, self.device, DECODE_MAX_PAIRS // topk,
                                              (self.pcie_percent, self.fetch.capacity, self.split_units),
                                              self.handshake)
        return self.host_steps[topk]

    def _host(self, layer: int, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One row per missed pair: each runs its one expert (by host bank entry) on the CPU -> [P, D]."""
        start = time.perf_counter()
        y = self.host_run(layer, rows, ids.unsqueeze(1), weights.unsqueeze(1))
        self._stats.host_seconds += time.perf_counter() - start
        self._stats.host_pairs += ids.numel()
        self._stats.host_bytes += int(ids.unique().numel()) * self.expert_bytes
        return y

    def host_experts(self, layer: int) -> int:
        """Experts of `layer` in its host bank (spare entries aside)."""
        return sum(e is not None for e in self.hosted[layer])

    @property
    def counts(self) -> torch.Tensor:
        """[MoE layers, experts] decayed routing counts: the steps' pick of slots adds to them in place."""
        return self.swap_policy.counts

    @property
    def decay(self) -> float:
        """The routing counts' decay per step."""
        return self.swap_policy.decay

    @decay.setter
    def decay(self, decay: float) -> None:
        self.swap_policy.decay = decay

    def rebalance(self, max_swaps: int) -> int:
        """Start moving up to `max_swaps` experts routed more often than a resident one into its slot (as
        offload/swap_policy.py decides), and put those whose copies are done in place; -> moves started. A
        move's copies run on copy streams beside the steps, which read both experts where they were until a
        later call commits it: no step waits on a swap. Each layer has as many moves under way as spare host
        entries (`spare_entries`)."""
        if self.swaps_held:
            return 0
        if self.settle_all:  # a calibration ran while swaps were held: its whole placement, once, exactly
            self.settle_all = False
            return self._settle()
        if max_swaps <= 0:  # swaps off: the counts still age, nothing is read back from the device
            self.swap_policy.age()
            return 0
        counts = self.swap_policy.read()  # also waits for the steps queued so far: none reads what a commit changes
        self._commit([m for m in self._moves if m.copied_all()])
        return self._start_moves(self.swap_policy.moves(counts, *self._move_state(), max_swaps))

    def _settle(self) -> int:
        """Every move the counts ask for, committed before returning (no step runs meanwhile); -> moves."""
        counts, made = self.swap_policy.read(), 0
        while True:
            for event in (e for m in self._moves for e in m.copied):
                event.synchronize()
            self._commit(list(self._moves))
            started = self._start_moves(self.swap_policy.every_move(counts, *self._move_state()))
            if not started:
                return made
            made += started

    def _move_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the policy weighs moves by, on the CPU (no device read): [L, E] experts in the host bank, [L, E]
        experts in a move under way, [L] layers with a spare host entry."""
        hosted = self.entry_of >= 0
        busy = torch.zeros_like(hosted)
        for m in self._moves:
            busy[self._index[m.layer], [m.incoming, m.outgoing]] = True
        open_layers = torch.tensor([bool(self._spare[layer]) for layer in self.layers])
        return hosted, busy, open_layers

    def _start_moves(self, moves: list[Move]) -> int:
        """Queue the copies of `moves` (rows of `layers`); -> moves started."""
        if moves and self._pin:
            for stream in self._copy_streams:  # after the steps (and commits) queued so far
                stream.wait_stream(torch.cuda.current_stream(self.device))
        for row, incoming, outgoing in moves:
            layer = self.layers[row]
            self._start(layer, self.resident[layer].index(outgoing), incoming)
        return len(moves)

    def _start(self, layer: int, slot: int, expert: int) -> None:
        """Copy the slot's expert into a spare host entry and the incoming expert into a device staging expert.
        Host memory is read once and written once per move, with no host-to-host copy to compete with the CPU
        experts' reads."""
        entry, spare = int(self.entry_of[self._index[layer], expert]), self._spare[layer].pop()
        staging = self._staging.pop() if self._staging else tuple(
            map_tensors(s, lambda t: torch.empty(t.shape[1:], dtype=t.dtype, device=t.device))
            for s in self.device_stacks[layer])
        for on_device, on_host, buffer in zip(self.device_stacks[layer], self.host[layer], staging):
            for name in tensor_fields(on_device):
                d, h, b = getattr(on_device, name), getattr(on_host, name), getattr(buffer, name)
                self._copy(h[spare], d[slot], 0)
                self._copy(b, h[entry], 1)
        copied = [stream.record_event() for stream in self._copy_streams]
        self._moves.append(_Move(layer, slot, expert, self.resident[layer][slot], entry, spare, staging, copied))

    def _commit(self, moves: list[_Move]) -> None:
        """The incoming experts into their slots, in the step stream (steps queued from now on run them there),
        and the maps switched: an outgoing expert is read from its spare entry, an incoming one's entry is
        spare. One copy call and one copy of each map for all of them."""
        if not moves:
            return
        slots, staged = [], []
        for move in moves:
            index = self._index[move.layer]
            for on_device, buffer in zip(self.device_stacks[move.layer], move.staging):
                for name in tensor_fields(on_device):
                    slots.append(getattr(on_device, name)[move.slot])
                    staged.append(getattr(buffer, name))
            self._slot_of_host[index, move.outgoing], self._slot_of_host[index, move.incoming] = -1, move.slot
            self.entry_of[index, move.incoming], self.entry_of[index, move.outgoing] = -1, move.spare
            self.resident[move.layer][move.slot], self.hosted[move.layer][move.spare] = move.incoming, move.outgoing
            self.hosted[move.layer][move.entry] = None
            self._spare[move.layer].append(move.entry)
            self._staging.append(move.staging)
            self._moves.remove(move)
        torch._foreach_copy_(slots, staged, non_blocking=True)
        self.bank.forget()  # its entries moved
        self.slot_of.copy_(self._slot_of_host, non_blocking=True)
        self.entry_on_device.copy_(self.entry_of, non_blocking=True)
        self._stats.swaps += len(moves)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
        """In the copy stream's order on a GPU, at once elsewhere."""
        if self._pin:
            copy_async(dst, src, self._copy_streams[stream])
        else:
            dst.copy_(src)
