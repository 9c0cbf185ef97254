"""Triton kernel cache keys that do not depend on which kernel was hashed first.

Triton (3.6) hashes a kernel together with the constexpr globals of everything it calls, but merges a
callee's into the caller's before it hashes the callee (`DependenciesFinder._update_hash`): a helper first
hashed from inside a kernel adds none of its constexprs, one hashed before adds all of them. The same
kernel then gets one key in a process that launched kernel A first and another in one that preloaded B
first (measured: `experts.prefill._down_kernel`, three keys in three H200 starts of the same code), so a
warm Triton cache misses, a recorded manifest's entries look stale and binaries another process compiled
are not found. Hashing every function again until no key changes gives each the key that holds all its
callees' constexprs, in any order: `settle_cache_keys` does that before a process hashes for a launch.
Triton fixed the order upstream (triton-lang/triton#10494, after 3.6); with such a Triton the first round
already agrees and the settling costs one more hashing pass.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
import threading
from types import ModuleType
from typing import Any, Iterable

log = logging.getLogger("glmflash.engine")

MAX_ROUNDS = 16  # one per level of calls; kernels here nest three or four deep


def _jit_function(value: Any) -> Any | None:
    """The JIT function inside autotuners and heuristics (their `.fn`), or None."""
    from triton.runtime.jit import JITFunction

    while not isinstance(value, JITFunction) and hasattr(value, "fn") and not isinstance(value, ModuleType):
        value = value.fn
    return value if isinstance(value, JITFunction) else None


def jit_functions(modules: Iterable[ModuleType]) -> list[Any]:
    """Every JIT function the modules hold, and those their modules hold, transitively (a helper imported
    by name sits in the kernel's module; its own helpers in the helper's)."""
    seen: dict[int, Any] = {}
    pending = list(modules)
    visited: set[str] = set()
    while pending:
        module = pending.pop()
        if module.__name__ in visited:
            continue
        visited.add(module.__name__)
        for value in list(vars(module).values()):
            fn = _jit_function(value)
            if fn is not None and id(fn) not in seen:
                seen[id(fn)] = fn
                home = sys.modules.get(fn.__module__)
                if home is not None:
                    pending.append(home)
    return list(seen.values())


def settle_cache_keys(modules: Iterable[ModuleType]) -> int:
    """Hash every JIT function of `modules` (see `jit_functions`) until no key changes -> rounds taken.
    Each round starts from the constexprs the last one gathered, so a key only grows to its complete set."""
    functions = jit_functions(modules)
    keys = [fn.cache_key for fn in functions]
    for rounds in range(1, MAX_ROUNDS + 1):
        for fn in functions:
            fn.hash = None
        now = [fn.cache_key for fn in functions]
        if now == keys:
            return rounds
        keys = now
    raise RuntimeError(f"Triton cache keys still changing after {MAX_ROUNDS} rounds")


# fla's modules that hold the KDA prefill's kernels and their helpers (all of fla.ops is ~330 functions and
# twice the time); a kernel elsewhere keeps an order-dependent key, as before.
FLA_KDA_MODULES = ("fla.ops.kda", "fla.ops.common", "fla.ops.gla", "fla.ops.utils", "fla.modules.norm")
SETTLED_PACKAGES = ("engine.kernels", *FLA_KDA_MODULES)


def settle_loaded() -> int:
    """`settle_cache_keys` over the loaded modules of our kernels and fla's KDA prefill."""
    return settle_cache_keys([module for name, module in list(sys.modules.items())
                              if module is not None and name.startswith(SETTLED_PACKAGES)])


_settled = threading.Lock()
_done = False


def settle_kernel_keys() -> None:
    """Once per process, before a GPU start hashes a kernel for its first launch or preload: every module of
    our kernels and fla's KDA prefill imported, then their keys settled."""
    global _done
    with _settled:
        if _done:
            return
        _done = True
        import engine.kernels

        for info in pkgutil.walk_packages(engine.kernels.__path__, "engine.kernels."):
            try:
                importlib.import_module(info.name)
            except ImportError:  # the CPU kernels' library sits beside them: loaded by ctypes, not imported
                continue
        try:
            from engine.kernels.kda.fla_import import import_fla_kda

            import_fla_kda()
            settle_loaded()
        except Exception as exc:  # noqa: BLE001 - keys then depend on the order, as without settling: slower, not wrong
            log.warning("event=kernel_keys_unsettled error=%r", exc)
