"""The compiled CPU NVFP4 GEMV (cpu_gemv.c) behind a torch-shaped call, and whether it is built.

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

from engine.weights import Fp8BlockWeight, Nvfp4Weight

_MODULE = "engine.kernels.experts._cpu_gemv"
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
    lib.fp8_block_gemv.argtypes = [_P, _I, _I, _P, _P, _I, _I, _I, _P, _P, ctypes.c_int, ctypes.c_int]
    lib.fp8_block_gemv.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled kernel is built and not switched off."""
    return os.environ.get("GLMFLASH_CPU_KERNELS", "auto") != "torch" and _library() is not None


@functools.lru_cache(maxsize=None)
def _fp8_table() -> torch.Tensor:
    """Byte -> e4m3 value, from torch's own codec (NaN bytes never occur in a scale)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _simd() -> int:
    return int(os.environ.get("GLMFLASH_CPU_KERNELS", "auto") != "portable")


def _operands(x: torch.Tensor, weight: Nvfp4Weight | Fp8BlockWeight, what: str
              ) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """(the library, x as contiguous fp32 rows, the fp32 output [R, N]) after checking the shapes."""
    lib = _library()
    assert lib is not None, "the CPU kernels are not built: check available() first"
    n, k = weight.shape
    xf = x.float().contiguous()
    if xf.dim() != 2 or xf.shape[1] != k:
        raise ValueError(f"{what}: x {tuple(x.shape)} against weight {weight.shape}")
    return lib, xf, torch.empty(xf.shape[0], n, dtype=torch.float32)


def nvfp4_gemv(x: torch.Tensor, weight: Nvfp4Weight, threads: int) -> torch.Tensor:
    """x [R, K] on the CPU @ dequantize(weight [N, K])^T -> fp32 [R, N], without expanding the weight."""
    lib, xf, y = _operands(x, weight, "nvfp4_gemv")
    (rows, k), n = xf.shape, y.shape[1]
    codes, scales = weight.packed.contiguous(), weight.scale.contiguous().view(torch.uint8)
    glob = weight.global_scale.float().contiguous()
    if glob.numel() not in (1, n):
        raise ValueError(f"nvfp4_gemv: weight {weight.shape} with a global scale of {glob.numel()} values")
    status = lib.nvfp4_gemv(xf.data_ptr(), rows, k, codes.data_ptr(), scales.data_ptr(), glob.data_ptr(),
                            0 if glob.numel() == 1 else 1, n, _fp8_table().data_ptr(), y.data_ptr(), threads, _simd())
    if status:
        raise ValueError(f"nvfp4_gemv: K = {k} is not a multiple of 16")
    return y


def fp8_block_gemv(x: torch.Tensor, weight: Fp8BlockWeight, threads: int) -> torch.Tensor:
    """x [R, K] on the CPU @ dequantize(weight [N, K])^T -> fp32 [R, N], without expanding the weight."""
    lib, xf, y = _operands(x, weight, "fp8_block_gemv")
    (rows, k), n = xf.shape, y.shape[1]
    data, scale_inv = weight.data.contiguous().view(torch.uint8), weight.scale_inv.float().contiguous()
    bn, bk = weight.block
    status = lib.fp8_block_gemv(xf.data_ptr(), rows, k, data.data_ptr(), scale_inv.data_ptr(), bn, bk, n,
                                _fp8_table().data_ptr(), y.data_ptr(), threads, _simd())
    if status:
        raise ValueError(f"fp8_block_gemv: block {weight.block} is not a positive size")
    return y
