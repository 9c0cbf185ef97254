"""One dispatch point per hot op: the model calls `kernel("op")`, never an implementation directly.

Each op registers a portable `torch` implementation (the reference CI tests) and may register a
`triton` one for CUDA; the Triton path is chosen on CUDA tensors unless GLMFLASH_KERNELS=torch.
"""

from __future__ import annotations

import os
from typing import Callable

_REGISTRY: dict[str, dict[str, Callable]] = {}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return wrap


def fast_kernels_enabled() -> bool:
    """False when GLMFLASH_KERNELS=torch forces the reference path everywhere (for comparisons)."""
    return os.environ.get("GLMFLASH_KERNELS", "auto") != "torch"


def kernel(op: str, device_type: str = "cpu") -> Callable:
    """The implementation of `op` for tensors on `device_type`."""
    impls = _REGISTRY[op]
    if device_type == "cuda" and "triton" in impls and fast_kernels_enabled():
        return impls["triton"]
    return impls["torch"]
