"""How a decode step's missed experts are split between the CPU and the PCIe link, from rates measured at load.

The CPU runs a missed expert at the rate its compiled pass reads host memory; the device runs one after
a kernel copies it over PCIe (reading the pinned host bank directly). Both proceed at once, so the
split that ends them together gives the link the share pcie / (cpu + pcie) of the misses. Measured on
the engine's own buffers and threads, a few experts of the first MoE layer each way (tens of
milliseconds), before the decode graphs are captured. That is where the split starts: the steps read it at
run time, and it then follows the rate the CPU's passes reach inside them (offload/split_follower.py;
74 GB/s on the H200's host where 8 experts alone ran 98). The rates are kept
in a file (beside the prepared snapshot, when the caller names one) under a key of what they depend on:
the same machine and weights start with the same split instead of a new sample of a noisy measurement.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from engine.kernels.experts.cpu_gemv import simd_path
from engine.cpu_cores import allowed_cpus, quota_cores
from engine.offload.host_steps import SPIN_NS


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
    """(CPU, PCIe) bytes per second on `experts` missed experts of the first MoE layer (batch-1 shaped; its
    host bank in a format the compiled CPU kernels take)."""
    layer = hybrid.layers[0]
    bank = hybrid.host[layer]
    n = min(experts, hybrid.host_experts(layer), hybrid.fetch.capacity)
    if n == 0:
        return 0.0, 0.0
    nbytes = n * hybrid.expert_bytes
    x = torch.randn(1, bank[0].shape[-1]).expand(n, -1).contiguous()
    ids, starts, weights = torch.arange(n), torch.arange(n + 1), torch.ones(n)
    # The compiled pass with its threads awake between calls, as in the decode steps' host functions.
    stacks, threads = hybrid.host_run.compiled[layer], hybrid.host_run.threads
    cpu = _best_of(3, lambda: stacks.forward(x, ids, starts, weights, hybrid.host_run.limit, threads, SPIN_NS))
    device = hybrid.device
    entries = torch.full((hybrid.fetch.capacity,), -1, dtype=torch.long, device=device)
    entries[:n] = torch.arange(n, device=device)
    parts = torch.full_like(entries, hybrid.split_units)

    def copy() -> None:
        hybrid.fetch.gather(bank, entries, parts, hybrid.split_units)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    pcie = _best_of(3, copy)
    return nbytes / cpu, nbytes / pcie


def pcie_percent(cpu_rate: float, pcie_rate: float) -> int:
    """The link's share of the misses (0-100) that makes both sides finish together."""
    total = cpu_rate + pcie_rate
    return round(100 * pcie_rate / total) if total > 0 else 0


def rates_key(hybrid) -> dict:
    """What the two rates depend on: the CPU, the cores and threads, the kernels' code path, the GPU, the
    expert's size and format."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    layer = hybrid.layers[0]
    return {"cpu": cpu, "cpus": len(allowed_cpus()), "cpu_quota": str(quota_cores()),
            "threads": hybrid.host_run.threads, "simd_path": simd_path(),
            "gpu": torch.cuda.get_device_name(hybrid.device) if hybrid.device.type == "cuda" else "",
            "expert_bytes": hybrid.expert_bytes, "format": type(hybrid.host[layer][0]).__name__}


def cached_rates(path: Path, key: dict) -> tuple[float, float] | None:
    """The (CPU, PCIe) rates kept in `path` under `key`; None when absent, unreadable or for another key."""
    try:
        kept = json.loads(path.read_text())
        return (float(kept["cpu_Bps"]), float(kept["pcie_Bps"])) if kept.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def keep_rates(path: Path, key: dict, rates: tuple[float, float]) -> None:
    """Writes the rates under `key` (whole or not at all: a new file renamed over the old)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"key": key, "cpu_Bps": rates[0], "pcie_Bps": rates[1]}, indent=1))
    os.replace(partial, path)


def choose_split(hybrid, topk: int, requested: int | None, rates_file: Path | None = None
                 ) -> tuple[int, tuple[float, float] | None]:
    """The split to use: `requested`, else from the (CPU, PCIe) rates (CUDA; 0 elsewhere), kept in
    `rates_file` under `rates_key` or measured now (and kept there), with those rates. Logs the rates and
    what they bound: the missed experts a token reads under uniform routing and the tok/s the host side
    allows at most."""
    layers = len(hybrid.layers)
    hosted = sum(hybrid.host_experts(layer) for layer in hybrid.layers) / max(layers, 1)
    miss_bytes = hosted / hybrid.num_experts * topk * layers * hybrid.expert_bytes
    if not hybrid.graph_safe:  # the host bank's format has no compiled CPU pass: misses take the eager path
        log.info("event=miss_split pcie_percent=0 reason=host_experts_uncompiled missed_gb_per_token=%.2f",
                 miss_bytes / 1e9)
        return 0, None
    if requested is not None or hybrid.device.type != "cuda":
        percent = 0 if requested is None else requested
        log.info("event=miss_split pcie_percent=%d missed_gb_per_token=%.2f", percent, miss_bytes / 1e9)
        return percent, None
    key = rates_key(hybrid)
    kept = cached_rates(rates_file, key) if rates_file is not None else None
    cpu, pcie = kept or miss_rates(hybrid)
    if rates_file is not None and kept is None:
        try:
            keep_rates(rates_file, key, (cpu, pcie))
        except OSError as error:  # a read-only volume: measured again at the next start
            log.warning("event=miss_split_not_kept path=%s error=%s", rates_file, error)
    percent = pcie_percent(cpu, pcie)
    bound = (cpu + pcie) / miss_bytes if miss_bytes else float("inf")
    log.info("event=miss_split cpu_GBps=%.1f pcie_GBps=%.1f rates=%s pcie_percent=%d missed_gb_per_token=%.2f "
             "host_bound_tok_s=%.1f", cpu / 1e9, pcie / 1e9, "kept" if kept else "measured", percent,
             miss_bytes / 1e9, bound)
    return percent, (cpu, pcie)
