"""How a decode step's missed experts are split between the CPU and the PCIe link, from rates measured at load.

The CPU runs a missed expert at the rate its compiled pass reads host memory; the device runs one after
a kernel copies it over PCIe (reading the pinned host bank directly). Both proceed at once, so the
split that ends them together gives the link the share pcie / (cpu + pcie) of the misses. Measured on
the engine's own buffers and threads, a few experts of the first MoE layer each way (tens of
milliseconds), before the decode graphs are captured (the share is built into them).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch


log = logging.getLogger("glmflash.engine")


def _best_of(runs: int, fn: Callable[[], None]) -> float:
    """Shortest of `runs` timed calls after one warm call (compiles, page faults), in seconds."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def miss_rates(hybrid, experts: int = 8) -> tuple[float, float]:
    """(CPU, PCIe) bytes per second on `experts` missed experts of the first MoE layer (batch-1 shaped)."""
    layer = hybrid.layers[0]
    bank = hybrid.host[layer]
    n = min(experts, len(hybrid.hosted[layer]), hybrid.fetch.capacity)
    if n == 0:
        return 0.0, 0.0
    nbytes = n * hybrid.expert_bytes
    x = torch.randn(1, bank[0].shape[-1]).expand(n, -1).contiguous()
    ids, weights = torch.arange(n).unsqueeze(1), torch.ones(n, 1)
    cpu = _best_of(3, lambda: hybrid.host_run(layer, x, ids, weights))
    device = hybrid.device
    entries = torch.full((hybrid.fetch.capacity,), -1, dtype=torch.long, device=device)
    entries[:n] = torch.arange(n, device=device)

    def copy() -> None:
        hybrid.fetch.gather(bank, entries)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    pcie = _best_of(3, copy)
    return nbytes / cpu, nbytes / pcie


def pcie_percent(cpu_rate: float, pcie_rate: float) -> int:
    """The link's share of the misses (0-100) that makes both sides finish together."""
    total = cpu_rate + pcie_rate
    return round(100 * pcie_rate / total) if total > 0 else 0


def choose_split(hybrid, topk: int, requested: int | None) -> tuple[int, tuple[float, float] | None]:
    """The split to use: `requested`, else measured (CUDA; 0 elsewhere), with the (CPU, PCIe) rates when
    measured. Logs the rates and what they bound: the missed experts a token reads under uniform routing
    and the tok/s the host side allows at most."""
    layers = len(hybrid.layers)
    hosted = sum(len(hybrid.hosted[layer]) for layer in hybrid.layers) / max(layers, 1)
    miss_bytes = hosted / hybrid.num_experts * topk * layers * hybrid.expert_bytes
    if not hybrid.graph_safe:  # the host bank's format has no compiled CPU pass: misses take the eager path
        log.info("event=miss_split pcie_percent=0 reason=host_experts_uncompiled missed_gb_per_token=%.2f",
                 miss_bytes / 1e9)
        return 0, None
    if requested is not None or hybrid.device.type != "cuda":
        percent = 0 if requested is None else requested
        log.info("event=miss_split pcie_percent=%d missed_gb_per_token=%.2f", percent, miss_bytes / 1e9)
        return percent, None
    cpu, pcie = miss_rates(hybrid)
    percent = pcie_percent(cpu, pcie)
    bound = (cpu + pcie) / miss_bytes if miss_bytes else float("inf")
    log.info("event=miss_split cpu_GBps=%.1f pcie_GBps=%.1f pcie_percent=%d missed_gb_per_token=%.2f "
             "host_bound_tok_s=%.1f", cpu / 1e9, pcie / 1e9, percent, miss_bytes / 1e9, bound)
    return percent, (cpu, pcie)
