"""Compile kernel-manifest entries into Triton's cache in processes of their own, while the weights load.

A compile inside the serving process shares its GIL with the loader's conversion: on a cold H200 start the
KDA kernels' seven compiles took 36 s beside the reads instead of 6.5 s alone, and the engine's own ~50 took
another 26 s after them (ops/BENCHMARKS.md). Child processes need no GPU (a compile targets an architecture,
not a device) and share nothing with the loader but cores; the cache they fill (TRITON_CACHE_DIR, inherited)
turns every later compile of the same specialization, the preload's or a kernel's first call, into a read.
A child reads its entries on stdin, gets the architecture (90 for sm_90) as its argument and prints how many
it compiled.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterator

from engine.kernels.manifest_store import resolve

log = logging.getLogger("glmflash.engine")

CHILD = "from engine.kernels.precompile import main; main()"  # not `-m`: the package imports this module first
CHILD_TIMEOUT_S = 240  # all children together; far above the ~30 s a 20 GB start's took


def localized(data: str) -> dict[str, Any]:
    """Specialization data recorded elsewhere (a manifest shipped with the package) for this installation:
    a library path that does not exist here (libdevice under another Triton install) is left to Triton's
    default, which is the same file (compiles hash its content, not its path)."""
    spec = json.loads(data)
    libs = spec["options"].get("extern_libs")
    if libs:
        kept = [[name, path] for name, path in libs if os.path.exists(path)]
        spec["options"]["extern_libs"] = kept or None
    return spec


def compile_offline(kernel: Any, spec: dict[str, Any], capability: int) -> None:
    """What `JITFunction.preload` compiles for `spec`, for a target instead of the current device."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    def constant(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        return tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value

    constexprs = {tuple(key): constant(value) for key, value in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(key): value for key, value in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {key: convert_to_tuple_if_list(value) for key, value in spec["signature"].items()}
    target = GPUTarget("cuda", capability, spec["options"].get("warp_size") or 32)
    options = make_backend(target).parse_options(
        {key: tuple(value) if isinstance(value, list) else value for key, value in spec["options"].items()})
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def precompile_processes() -> int:
    """A quarter of the cores, at most 4: each child first imports torch and the kernels' modules."""
    return max(1, min(4, (os.cpu_count() or 2) // 4))


def split_by_package(entries: list[dict[str, str]], processes: int) -> list[list[dict[str, str]]]:
    """Shares for `processes` children: each smaller package's kernels (fla's: its import alone takes seconds)
    in one share, the largest package's spread over the processes left (at least one), alternating so costly
    tiles mix."""
    packages: dict[str, list[dict[str, str]]] = {}
    for entry in entries:
        packages.setdefault(entry["module"].split(".")[0], []).append(entry)
    groups = sorted(packages.values(), key=len)
    shares = []
    for index, group in enumerate(groups):
        n = 1 if index < len(groups) - 1 else max(1, processes - len(shares))
        shares += [group[i::n] for i in range(n) if group[i::n]]
    return shares


def _compile_share(index: int, share: list[dict[str, str]], capability: int, deadline: float) -> int:
    """One child compiling `share` (handed over on its stdin) -> entries it compiled; a child that fails or
    outlives `deadline` only costs its share."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(capability)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(json.dumps(share), timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # the engine waits on this: a stuck child only loses its share
        child.kill()
        child.communicate()
        log.warning("event=kernel_precompile_failed error=timeout seconds=%d", CHILD_TIMEOUT_S)
        return 0
    for line in err.splitlines():  # the kernels a child could not compile, one line each
        if line.startswith("event="):
            log.warning(line)
    if child.returncode != 0:
        log.warning("event=kernel_precompile_failed error=%r", err.strip().splitlines()[-1:])
        return 0
    compiled = int(out.strip().splitlines()[-1])
    log.info("event=kernel_precompile child=%d package=%s kernels=%d compiled=%d seconds=%.1f", index,
             share[0]["module"].split(".")[0], len(share), compiled, time.perf_counter() - start)
    return compiled


def precompile(entries: list[dict[str, str]], capability: int,
               processes: int) -> Iterator[tuple[list[dict[str, str]], int]]:
    """Start `processes` children compiling the entries into Triton's cache, now -> an iterator of (share,
    entries of it compiled) in the order the children finish, so a share can be loaded while the others
    still compile."""
    shares = split_by_package(entries, processes)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    pool = ThreadPoolExecutor(max(1, len(shares)), thread_name_prefix="kernel-precompile")
    running = {pool.submit(_compile_share, i, share, capability, deadline): share for i, share in enumerate(shares)}
    pool.shutdown(wait=False)

    def finished() -> Iterator[tuple[list[dict[str, str]], int]]:
        for future in as_completed(running):
            yield running[future], future.result()

    return finished()


def main() -> None:
    from engine.kernels.cache_keys import settle_loaded

    entries, capability = json.loads(sys.stdin.read()), int(sys.argv[1])
    if any(entry["module"].startswith("fla.") for entry in entries):
        from engine.kernels.kda.fla_import import import_fla_kda

        import_fla_kda()  # without torch's compiler stack, as the serving process imports it
    kernels = []
    for entry in entries:
        try:
            kernels.append(resolve(entry["module"], entry["name"]))
        except Exception as exc:  # noqa: BLE001 - reported below
            kernels.append(exc)
    settle_loaded()  # the keys the serving process gives the same kernels: its cache finds these binaries
    compiled = 0
    for entry, kernel in zip(entries, kernels):
        try:
            if isinstance(kernel, Exception):
                raise kernel
            if kernel.cache_key == entry["source"]:
                compile_offline(kernel, localized(entry["data"]), capability)
                compiled += 1
        except Exception as exc:  # noqa: BLE001 - that kernel compiles at its first call instead
            print(f"event=kernel_precompile_failed kernel={entry['module']}.{entry['name']} error={exc!r}",
                  file=sys.stderr)
    print(compiled)

