"""fla's KDA ops imported without torch's compiler stack.

`import fla.ops.kda` runs the `fla.ops` package's init, which imports every fla op; their `@torch.compile`
and `@torch.compiler.disable` decorators import torch._dynamo and inductor as they are applied. On an H200
start that made the kernels' imports 10.8 s of the kernel preload (ops/BENCHMARKS.md), the critical path of
an early-readiness start, on the GIL beside the weight reads; on a 2-vCPU VM the compiler stack was 5 of
fla's 9 s. This engine never runs under torch.compile and calls none of fla's compiled helpers, so while
fla is imported `torch.compile` defers its work to a function's first call (the same compile, later) and
`torch.compiler.disable`, which only acts inside a compiled region, returns the function as it is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
from typing import Any, Callable, Iterator

import torch

_lock = threading.Lock()


def _deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    def compile(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile(fn, **options)
        compiled: list[Any] = []

        @functools.wraps(model)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return run

    return compile


def _left_as_is(fn: Any = None, recursive: bool = True, *, reason: str | None = None) -> Any:
    return fn if fn is not None else (lambda f: f)


@contextlib.contextmanager
def compiler_deferred() -> Iterator[None]:
    """While inside: `torch.compile` compiles at a function's first call, `torch.compiler.disable` is the
    identity. One thread at a time (the originals are put back on the way out)."""
    with _lock:
        real_compile, real_disable = torch.compile, torch.compiler.disable
        torch.compile, torch.compiler.disable = _deferred_compile(real_compile), _left_as_is
        try:
            yield
        finally:
            torch.compile, torch.compiler.disable = real_compile, real_disable


def import_fla_kda() -> Any:
    """`fla.ops.kda`, imported under `compiler_deferred` unless already imported (then torch is left alone)."""
    if "fla.ops.kda" in sys.modules:
        return sys.modules["fla.ops.kda"]
    with compiler_deferred():
        return importlib.import_module("fla.ops.kda")
