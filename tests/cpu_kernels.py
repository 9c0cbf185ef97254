"""How close the compiled CPU expert kernels come to the float64 and torch references, by code path, and
which code path each GLMFLASH_CPU_KERNELS mode must run on this CPU."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.kernels.experts import cpu_gemv
from engine.weights import Fp8BlockWeight, Nvfp4Weight

PATH_NAMES = ("portable", "AVX2", "AVX-512", "AVX-512 VNNI")  # cpu_gemv.c's paths, by number
# The /proc/cpuinfo flags each path's code is compiled for (cpu_gemv.c's target attributes), by path number.
PATH_FLAGS = ((), ("avx2", "fma", "f16c"), ("avx512f", "avx512bw"), ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
MODE_PATHS = {"avx2": 1, "avx512": 2, "portable": 0}  # the path each mode names (module docstring of cpu_gemv)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, from /proc/cpuinfo: not through the kernels' own detection (level_for)."""
    with open("/proc/cpuinfo") as cpuinfo:
        return frozenset(next(line for line in cpuinfo if line.startswith("flags")).split(":")[1].split())


def missing_flags(path: int) -> list[str]:
    return [flag for flag in PATH_FLAGS[path] if flag not in cpu_flags()]


def use_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> int:
    """Sets GLMFLASH_CPU_KERNELS=`mode` and forgets the paths run so far -> the path NVFP4 must run on in it:
    the one the mode names, skipping where this CPU lacks it (else the case would test a narrower path
    again); `auto`, the widest this CPU has."""
    if mode == "auto":
        path = max(p for p in range(len(PATH_FLAGS)) if not missing_flags(p))
    elif lacking := missing_flags(path := MODE_PATHS[mode]):
        pytest.skip(f"this CPU lacks {', '.join(lacking)}: the {PATH_NAMES[path]} path cannot run here")
    monkeypatch.setenv("GLMFLASH_CPU_KERNELS", mode)
    cpu_gemv.take_paths_run()
    return path


def weight_path(path: int, weight: Nvfp4Weight | Fp8BlockWeight) -> int:
    """The path `weight` runs on where NVFP4 runs on `path`: FP8 has no VNNI path (AVX-512 runs there), and a
    K or a block's K not a multiple of 16 takes the portable one."""
    if isinstance(weight, Nvfp4Weight):
        return path
    if weight.shape[-1] % 16 or weight.block[1] % 16:
        return 0
    return min(path, 2)


def assert_ran(*paths: int) -> None:
    """The kernels ran rows on exactly these paths since the last check (as cpu_gemv.c recorded them)."""
    ran, want = cpu_gemv.take_paths_run(), set(paths)
    assert ran == want, f"ran {[PATH_NAMES[p] for p in sorted(ran)]}, not {[PATH_NAMES[p] for p in sorted(want)]}"


def assert_expert_close(got: torch.Tensor, want: torch.Tensor, fmt: str) -> None:
    """A whole expert pass against the reference: within 1e-5, or where NVFP4 runs with x in 16-bit integers
    (AVX2, AVX-512 VNNI) within 1e-4 of the output's scale (its largest |value|): both projections' inputs are
    rounded to 1/65278 of each 16 columns' largest value, measured ~4e-5 of the scale after the two; a wrong
    scale, group or row is off by O(1) of it."""
    if fmt.startswith("nvfp4") and cpu_gemv.available() and cpu_gemv.simd_path() in cpu_gemv.X16_PATHS:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
