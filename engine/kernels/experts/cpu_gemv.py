"""The compiled CPU NVFP4 GEMV (cpu_nvfp4.c) behind a torch-shaped call, and whether it is built.

`pip install -e .` compiles it where a C compiler exists; elsewhere `available()` is False and the
CPU expert executor keeps its torch path. GLMFLASH_CPU_KERNELS=torch forces that path,
=portable the C code without SIMD (both for comparisons).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import torch

from engine.weights import Nvfp4Weight

_MODULE = "engine.kernels.experts._cpu_nvfp4"
_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.nvfp4_gemv.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I, _P, _P, ctypes.c_int, ctypes.c_int]
    lib.nvfp4_gemv.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled kernel is built and not switched off."""
    return os.environ.get("GLMFLASH_CPU_KERNELS", "auto") != "torch" and _library() is not None


@functools.lru_cache(maxsize=None)
def _fp8_table() -> torch.Tensor:
    """Byte -> e4m3 value, from torch's own codec (NaN bytes never occur in a scale)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def nvfp4_gemv(x: torch.Tensor, weight: Nvfp4Weight, threads: int) -> torch.Tensor:
    """x [R, K] on the CPU @ dequantize(weight [N, K])^T -> fp32 [R, N], without expanding the weight."""
    lib = _library()
    assert lib is not None, "the CPU kernel is not built: check available() first"
    xf = x.float().contiguous()
    rows, k = xf.shape
    n = weight.shape[0]
    codes, scales = weight.packed.contiguous(), weight.scale.contiguous().view(torch.uint8)
    glob = weight.global_scale.float().contiguous()
    if k != weight.shape[1] or glob.numel() not in (1, n):
        raise ValueError(f"nvfp4_gemv: x {tuple(xf.shape)} against weight {weight.shape} "
                         f"with global scale of {glob.numel()} values")
    table = _fp8_table()
    y = torch.empty(rows, n, dtype=torch.float32)
    simd = int(os.environ.get("GLMFLASH_CPU_KERNELS", "auto") != "portable")
    status = lib.nvfp4_gemv(xf.data_ptr(), rows, k, codes.data_ptr(), scales.data_ptr(), glob.data_ptr(),
                            0 if glob.numel() == 1 else 1, n, table.data_ptr(), y.data_ptr(), threads, simd)
    if status:
        raise ValueError(f"nvfp4_gemv: K = {k} is not a multiple of 16")
    return y
