"""The cores this process may use, and which of them the CPU expert threads are pinned to.

A container limited by a CPU quota (`docker run --cpus`, cgroup `cpu.max`) still sees every core of the host
in its affinity mask, and torch sizes its thread team by that mask: 64 threads on a 64-core host under a
quota of 8 cores spend most of their time throttled. So thread counts come from `usable_cores()`, the mask
capped by the quota. Pinning is only meaningful where the mask is the limit (a cpuset, or no limit at all):
under a quota the kernel decides where the threads run, and pinning them to cores other tenants use hurts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from engine.kernels.experts.cpu_gemv import pinned_cpus

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller name ('' for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path.lstrip("/")
    return paths


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float:
    """The CPU quota of this process's cgroup in cores (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), infinite when there is none. Looks in the process's own cgroup, then at the root
    of the mount (a container's cgroup namespace shows its own cgroup there)."""
    paths = _cgroup_paths(proc_cgroup)
    v2 = [root / paths.get("", ""), root]
    v1 = [root / "cpu" / paths.get("cpu", ""), root / "cpu", root / "cpu,cpuacct"]
    for folder in v2:
        text = _read(folder / "cpu.max")
        if text is not None:
            quota, _, period = text.partition(" ")
            return math.inf if quota == "max" else int(quota) / int(period or 100000)
    for folder in v1:
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return math.inf if int(quota) < 0 else int(quota) / int(period)
    return math.inf


def usable_cores(cpus: list[int] | None = None, quota: float | None = None) -> int:
    """Threads this process can keep busy at once: its affinity mask, capped by its CPU quota (both read
    from the system unless given)."""
    count = len(allowed_cpus() if cpus is None else cpus)
    quota = quota_cores() if quota is None else quota
    return max(1, math.ceil(min(count, quota)))


def cap_torch_threads(cores: int | None = None) -> tuple[int, int]:
    """Lowers torch's intra-op thread count to `cores` (default: the usable cores; torch counts the mask,
    not the quota); returns (before, after). For a process's entry point: the count is process-wide."""
    before = torch.get_num_threads()
    after = min(before, cores or usable_cores())
    if after < before:
        torch.set_num_threads(after)
    return before, after


def core_of(cpus: list[int], topology: Path = CPU_TOPOLOGY) -> dict[int, tuple]:
    """CPU -> its physical core (package, core id); each CPU its own core when the topology is not readable."""
    cores = {}
    for cpu in cpus:
        core = (_read(topology / f"cpu{cpu}" / "topology" / "physical_package_id"),
                _read(topology / f"cpu{cpu}" / "topology" / "core_id"))
        if None in core:
            return {cpu: (cpu,) for cpu in cpus}
        cores[cpu] = core
    return cores


def physical_cores(cpus: list[int], topology: Path = CPU_TOPOLOGY) -> list[int]:
    """One CPU of each physical core among `cpus` (its first SMT sibling), in order: two spinning threads
    on siblings share one core's load ports."""
    return _first_of_each_core(core_of(cpus, topology))


def _first_of_each_core(core: dict[int, tuple]) -> list[int]:
    first: dict[tuple, int] = {}
    for cpu, key in core.items():
        first.setdefault(key, cpu)
    return list(first.values())


def worker_cpus(threads: int, cpus: list[int] | None = None, quota: float | None = None,
                topology: Path = CPU_TOPOLOGY) -> list[int]:
    """The CPUs to pin the expert pool's workers to (thread ids 1..threads-1, the caller being 0), one each;
    empty when they should float: under a CPU quota, or with more workers than the mask has CPUs besides
    the first. The first core stays free for the caller and the threads that drive the device: workers go
    to the other physical cores, then to their SMT siblings, then to the first core's siblings."""
    cpus = allowed_cpus() if cpus is None else cpus
    quota = quota_cores() if quota is None else quota
    workers = threads - 1
    if workers < 1 or quota < len(cpus) or workers > len(cpus) - 1:
        return []
    core = core_of(cpus, topology)
    firsts = _first_of_each_core(core)
    siblings = [cpu for cpu in cpus if cpu not in firsts]
    order = (firsts[1:] + [cpu for cpu in siblings if core[cpu] != core[cpus[0]]]
             + [cpu for cpu in siblings if core[cpu] == core[cpus[0]]])
    return order[:workers]


def background_cpus(pinned: list[int] | None = None, cpus: list[int] | None = None) -> list[int]:
    """The CPUs for work beside serving (the prepared snapshot's write) -> those no CPU expert worker is pinned
    to (`pinned`, default: the pool's now), the first CPU (the caller's and the device threads') only where
    nothing else is left; every CPU where the workers float. Such work runs at the normal priority: a thread
    below it that takes the GIL and is then kept waiting for a core holds up the serving thread (ops/
    bench_writer_stalls on 16 cores: its longest wait 556 ms under SCHED_IDLE writers, 231 ms at nice 19, 11 ms
    at the normal priority)."""
    cpus = allowed_cpus() if cpus is None else cpus
    pinned = set(pinned_cpus() if pinned is None else pinned)
    if not pinned:
        return cpus
    free = [cpu for cpu in cpus if cpu not in pinned]
    return [cpu for cpu in free if cpu != cpus[0]] or free or cpus
