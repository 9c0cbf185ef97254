"""Usable cores under cgroup quotas and masks, and where the CPU expert threads are pinned (real files in a
fake cgroup and CPU topology tree; the pinning itself on this machine's threads)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.experts.cpu_experts import CpuExperts
from engine.kernels.experts import cpu_gemv
from engine.cpu_cores import background_cpus, physical_cores, quota_cores, usable_cores, worker_cpus
from tests.engine.kernels.test_cpu_gemv import nvfp4_stacks


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_quota_from_cgroup_v2_in_the_process_cgroup_and_at_the_root(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/docker/abc\n")
    write(tmp_path / "fs/docker/abc/cpu.max", "250000 100000\n")
    write(tmp_path / "fs/cpu.max", "max 100000\n")
    assert quota_cores(tmp_path / "fs", proc) == 2.5
    (tmp_path / "fs/docker/abc/cpu.max").unlink()  # a cgroup namespace: the container's cgroup is the root
    assert quota_cores(tmp_path / "fs", proc) == math.inf
    write(tmp_path / "fs/cpu.max", "400000 100000\n")
    assert quota_cores(tmp_path / "fs", proc) == 4.0


def test_quota_from_cgroup_v1_and_none_without_files(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "4:memory:/x\n1:cpu,cpuacct:/x\n0::/\n")
    write(tmp_path / "fs/cpu/x/cpu.cfs_quota_us", "150000\n")
    write(tmp_path / "fs/cpu/x/cpu.cfs_period_us", "100000\n")
    assert quota_cores(tmp_path / "fs", proc) == 1.5
    write(tmp_path / "fs/cpu/x/cpu.cfs_quota_us", "-1\n")
    assert quota_cores(tmp_path / "fs", proc) == math.inf
    assert quota_cores(tmp_path / "empty", tmp_path / "missing") == math.inf


def test_usable_cores_is_the_mask_capped_by_the_quota():
    assert usable_cores(list(range(64)), 8.0) == 8
    assert usable_cores(list(range(64)), 2.5) == 3
    assert usable_cores([0, 1, 2], math.inf) == 3
    assert usable_cores([5], 0.2) == 1
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def topology(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        write(root / f"cpu{cpu}/topology/physical_package_id", f"{package}\n")
        write(root / f"cpu{cpu}/topology/core_id", f"{core}\n")
    return root


def test_workers_go_to_physical_cores_first_and_leave_the_first_core(tmp_path):
    # 8 CPUs: 0-3 are the first threads of four cores, 4-7 their SMT siblings.
    topo = topology(tmp_path, {cpu: (0, cpu % 4) for cpu in range(8)})
    cpus = list(range(8))
    assert physical_cores(cpus, topo) == [0, 1, 2, 3]
    assert worker_cpus(4, cpus, math.inf, topo) == [1, 2, 3]
    assert worker_cpus(7, cpus, math.inf, topo) == [1, 2, 3, 5, 6, 7]
    assert worker_cpus(8, cpus, math.inf, topo) == [1, 2, 3, 5, 6, 7, 4]  # the first core's sibling last
    assert worker_cpus(9, cpus, math.inf, topo) == []  # more workers than cores: they float
    assert worker_cpus(4, cpus, 4.0, topo) == []  # under a quota the kernel places threads
    assert worker_cpus(1, cpus, math.inf, topo) == []  # the caller alone
    # Two packages with the same core ids are different cores; an unreadable topology counts every CPU.
    two = topology(tmp_path / "two", {0: (0, 0), 1: (1, 0), 2: (0, 0), 3: (1, 0)})
    assert physical_cores([0, 1, 2, 3], two) == [0, 1]
    assert physical_cores([0, 1, 2], tmp_path / "none") == [0, 1, 2]


def expert_threads() -> dict[int, str]:
    """The pool's worker threads of this process: tid -> the CPUs each may run on."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "glmflash-expert":
            status = (task / "status").read_text()
            found[int(task.name)] = next(line.split()[1] for line in status.splitlines()
                                         if line.startswith("Cpus_allowed_list"))
    return found


def test_pinned_workers_run_on_their_cores_and_unpin(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("pinning a worker to a core of its own needs two CPUs")
    stacks = nvfp4_stacks(128, 96, 4, seed=1)
    x, ids, weights = torch.randn(2, 128), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    want = CpuExperts(stacks, 1.5, threads=1)(0, x, ids, weights)
    run = CpuExperts(stacks, 1.5, threads=2)
    try:
        cpu_gemv.pin_workers([cpus[-1]])
        assert torch.allclose(run(0, x, ids, weights), want, rtol=1e-5, atol=1e-5)  # starts the worker if needed
        pinned = expert_threads()
        assert pinned, "no thread named glmflash-expert: the pool did not start or name its workers"
        assert str(cpus[-1]) in pinned.values()  # worker 1
        assert cpu_gemv.pinned_cpus() == [cpus[-1]] and cpus[-1] not in background_cpus()
    finally:
        cpu_gemv.pin_workers([])
    mask = (Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0])
    assert set(expert_threads().values()) == {mask}
    assert cpu_gemv.pinned_cpus() == [] and background_cpus() == cpus
    assert torch.allclose(run(0, x, ids, weights), want, rtol=1e-5, atol=1e-5)


def test_torch_threads_are_capped_at_the_usable_cores():
    """In a child process: the thread count is process-wide."""
    code = ("import torch; from engine.cpu_cores import cap_torch_threads; torch.set_num_threads(3); "
            "print(cap_torch_threads(2), cap_torch_threads(5), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2]).stdout
    assert out.split() == ["(3,", "2)", "(2,", "2)", "2"]


def test_background_work_goes_beside_the_pinned_expert_workers():
    """Where the workers are pinned, the CPUs none of them holds, the first (the caller's) only as a last resort;
    where they float, any CPU."""
    cpus = list(range(16))
    assert background_cpus(list(range(1, 15)), cpus) == [15]
    assert background_cpus(list(range(1, 16)), cpus) == [0]
    assert background_cpus([], cpus) == cpus
    assert background_cpus([1, 3], [0, 1, 2, 3]) == [2]
    assert background_cpus(cpus, cpus) == cpus  # nothing free: nowhere better to go
