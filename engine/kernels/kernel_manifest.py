"""The Triton kernel specializations a model compiles, kept beside its prepared snapshot so the next start
compiles them in the background while the weights are read, not inside the engine's build or the first
requests.

Triton compiles a kernel the first time a call meets a new specialization (argument dtypes, which integers
are 1 or multiples of 16, the constexprs). With an empty Triton cache that took ~90 s of this model's start
on an H200 (ops/BENCHMARKS.md), after the reads, and a new prefill shape can still cost seconds after ready.
`CompileLog` hooks Triton's compiler (`knobs.runtime.jit_cache_hook` before each compile and
`jit_post_compile_hook` after it, chained to hooks already set): it times every compile and keeps each
one's specialization data, written to the manifest once the engine has started and at each compile after
that. A later start on the same GPU architecture, Triton, dtype and model dimensions calls each kernel's
`preload` with it (compile, or read Triton's cache, without running anything) on threads of their own,
started with the weight reads; the engine waits for them before its first kernel runs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.config import ModelConfig
from engine.kernels.background import OncePerKey
from engine.kernels.cache_keys import settle_kernel_keys
from engine.kernels.manifest_store import merged_entries, packaged_manifest, read_manifest, read_warm_up, resolve
from engine.kernels.prebuilt import seeded_manifest
from engine.kernels.precompile import localized, precompile, precompile_processes

log = logging.getLogger("glmflash.engine")


def manifest_key(device: torch.device, dtype: torch.dtype, shapes: str) -> dict[str, str]:
    """What a manifest is valid for: its specializations name dtypes and a model's dimensions (`model_shapes`),
    its binaries a GPU architecture (an H100's serve an H200) and a Triton."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {"capability": f"{major}.{minor}", "triton": triton.__version__, "dtype": str(dtype).removeprefix("torch."),
            "shapes": shapes}


def model_shapes(config: ModelConfig) -> str:
    """The dimensions the kernels specialize on (not the layer count: a slice of the release compiles what the
    release does), so a manifest shipped for the release is not preloaded for another model."""
    return (f"hidden={config.hidden_size},experts={config.n_routed_experts},moe={config.moe_intermediate_size},"
            f"kda={config.linear_num_heads}x{config.linear_head_dim},vocab={config.vocab_size}")


@dataclass
class CompileLog:
    """Compiles seen in this process: count, seconds and the slowest kernels, and the manifest's entries."""

    key: dict[str, str] = field(default_factory=dict)
    file: Path | None = None  # the manifest: written once the engine has started, then at each new compile
    serving: bool = False  # after the engine's start each compile is logged on its own (a latency hit)
    count: int = 0
    seconds: float = 0.0
    by_kernel: dict[str, float] = field(default_factory=dict)
    entries: dict[str, dict[str, str]] = field(default_factory=dict)  # specialization data -> entry
    # The prefill warm-up's record ({"signature", "lengths"}): this start's, written with the manifest, and an
    # earlier start's, read from it; whether the preload found every kernel the manifests name.
    warmed: dict | None = None
    earlier_warm_up: dict | None = None
    preloaded_all: bool = False
    _started: dict[tuple[int, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def before(self, **kwargs: Any) -> None:
        self._started[(threading.get_ident(), str(kwargs["key"]))] = time.perf_counter()

    def after(self, **kwargs: Any) -> None:
        start = self._started.pop((threading.get_ident(), str(kwargs["key"])), None)
        seconds = time.perf_counter() - start if start is not None else 0.0
        fn, data = kwargs["fn"], kwargs["compile"]["specialization_data"]
        name = f"{fn.module}.{fn.name}"
        with self._lock:
            self.count += 1
            self.seconds += seconds
            self.by_kernel[name] = self.by_kernel.get(name, 0.0) + seconds
            new = data not in self.entries
            if new:
                self.entries[data] = {"module": str(fn.module), "name": fn.name, "data": data,
                                      "source": fn.jit_function.cache_key}
            if new and self.serving and self.file is not None:  # rare by then: one write each
                self._write()
        if self.serving:
            log.info("event=kernel_compile kernel=%s seconds=%.2f", name, seconds)

    def keep(self, file: Path | None, key: dict[str, str]) -> None:
        """The manifest lives in `file` under `key` (none is written while `file` is None)."""
        with self._lock:
            self.key, self.file = key, file

    def started(self) -> str:
        """The engine has started: write the manifest of what its start compiled (not at every compile of
        the start, whose writes would compete with the reads) -> a summary for the log."""
        with self._lock:
            self.serving = True
            if self.file is not None and self.entries:
                self._write()
        return self.summary()

    def covered_prefills(self, signature: dict) -> list[int] | None:
        """The lengths an earlier start's prefill warm-up ran under the same `signature` (what decides the kernels a
        prefill runs: its longest step, hybrid offload, the latent cache's dtype, drafts), where the preload has read
        every kernel its manifest names (what those prefills compiled among them): running them again would compile
        nothing (an H100's fast_resume: 2.4 s of prefills, no compile). None: the warm-up must run."""
        record = self.earlier_warm_up
        if not self.preloaded_all or record is None or record["signature"] != signature:
            return None
        return list(record["lengths"])

    def summary(self, slowest: int = 5) -> str:
        top = sorted(self.by_kernel.items(), key=lambda item: -item[1])[:slowest]
        names = ",".join(f"{name.rsplit('.', 1)[-1]}:{seconds:.1f}" for name, seconds in top) or "none"
        return f"count={self.count} seconds={self.seconds:.1f} kernels={len(self.by_kernel)} slowest={names}"

    def _write(self) -> None:
        """Atomically, so a start killed mid-write leaves the last whole manifest (or none)."""
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            part = self.file.with_name(f".{self.file.name}.{os.getpid()}.part")
            manifest = {"key": self.key, "kernels": list(self.entries.values())}
            if self.warmed is not None:
                manifest["warmed"] = self.warmed
            part.write_text(json.dumps(manifest))
            os.replace(part, self.file)
        except OSError as exc:  # a read-only volume: the next start compiles as this one did
            log.warning("event=kernel_manifest_unwritable file=%s error=%r", self.file, exc)
            self.file = None


COMPILES = CompileLog()
_installed = False


def record_compiles(file: Path | None, key: dict[str, str]) -> CompileLog:
    """Hook Triton's compiler into COMPILES (once per process) and keep its manifest in `file` under `key`."""
    global _installed
    if not _installed:
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs (before 3.4): nothing is recorded
            return COMPILES
        knobs.runtime.jit_cache_hook = _chained(knobs.runtime.jit_cache_hook, COMPILES.before)
        knobs.runtime.jit_post_compile_hook = _chained(knobs.runtime.jit_post_compile_hook, COMPILES.after)
        _installed = True
    COMPILES.keep(file, key)
    return COMPILES


def _chained(previous: Callable[..., Any] | None, ours: Callable[..., None]) -> Callable[..., Any]:
    """Ours, then a hook set before (whose truthy answer to jit_cache_hook skips the compile, as Triton's)."""
    def hook(**kwargs: Any) -> Any:
        ours(**kwargs)
        return previous(**kwargs) if previous is not None else None
    return hook


def preload(entries: list[dict[str, str]], workers: int = 1,
            initializer: Callable[[], None] | None = None) -> tuple[int, float]:
    """Compile (or read from Triton's cache) every entry's specialization on `workers` threads (Triton's
    compiler leaves the GIL to its passes and ptxas: ~1.7x on 2 cores) -> (kernels preloaded, seconds).
    An entry whose kernel's source changed since is skipped (its calls will meet other specializations);
    one that fails (a kernel renamed) with a warning: its first call compiles it."""
    def one(entry: dict[str, str]) -> bool:
        try:
            kernel = resolve(entry["module"], entry["name"])
            if kernel.cache_key != entry["source"]:
                return False
            kernel.preload(json.dumps(localized(entry["data"])))
            return True
        except Exception as exc:  # noqa: BLE001 - any failure leaves the kernel to its first call
            log.warning("event=kernel_preload_failed kernel=%s.%s error=%r", entry["module"], entry["name"], exc)
            return False

    start = time.perf_counter()
    for entry in entries:  # imports first, on one thread: a module imported from two at once can deadlock
        try:
            importlib.import_module(entry["module"])
        except Exception:  # noqa: BLE001 - reported by `one`
            pass
    with ThreadPoolExecutor(workers, thread_name_prefix="kernel-preload", initializer=initializer) as pool:
        done = sum(pool.map(one, entries))
    return done, time.perf_counter() - start


def preload_workers() -> int:
    """Half the cores (the reads convert and copy on the rest), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def manifest_entries(file: Path, key: dict[str, str]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(what Triton's cache holds already: what an earlier start recorded in `file` and what the cache was
    seeded with by an image (engine/kernels/prebuilt.py); that and what the package ships besides)."""
    from triton import knobs

    cached = merged_entries(read_manifest(file, key), seeded_manifest(Path(knobs.cache.dir), key))
    return cached, merged_entries(cached, read_manifest(packaged_manifest(key), key))


def start_preload(file: Path | None, device: torch.device, dtype: torch.dtype, shapes: str = "",
                  processes: int | None = None) -> Future:
    """Record this process's compiles into `file` and preload what an earlier start recorded there, what an
    image seeded Triton's cache with and what the package ships for this GPU, in the background: the shipped
    ones the cache lacks compiled into it by child processes, then all loaded from it (or compiled here, when
    the cache was emptied) -> a future of (kernels preloaded, seconds). `processes`: children (0: none, None:
    `precompile_processes()`). Without a file compiles are only counted."""
    if file is None:
        record_compiles(None, {})
        done: Future = Future()
        done.set_result((0, 0.0))
        return done
    if (started := _preloads.started(file)) is not None:
        return started
    key = manifest_key(device, dtype, shapes)
    cached, entries = manifest_entries(file, key)
    new = entries[len(cached):]
    record_compiles(file, key)
    COMPILES.earlier_warm_up = read_warm_up(file, key)
    major, minor = torch.cuda.get_device_capability(device)

    def on_device() -> None:  # Triton compiles for the thread's current device
        torch.cuda.set_device(device)

    def run() -> tuple[int, float]:
        start = time.perf_counter()
        try:
            # What an earlier start recorded or an image seeded is in Triton's cache already: only the rest, by
            # children started before this process settles its keys (fla's import takes seconds).
            children = precompile_processes() if processes is None else processes
            finished = precompile(new, major * 10 + minor, children) if new and children else iter([(new, 0)])
            settle_kernel_keys()  # the keys the entries' sources were recorded under, whatever runs first
            done, _ = preload(cached, preload_workers(), on_device)
            compiled = 0
            for share, count in finished:  # each share once its child ends: reads of what it compiled
                compiled += count
                done += preload(share, preload_workers(), on_device)[0]
        except Exception as exc:  # noqa: BLE001 - the kernels then compile at their first call, as without a file
            log.warning("event=kernel_preload_failed error=%r", exc)
            return 0, 0.0
        seconds = time.perf_counter() - start
        COMPILES.preloaded_all = done == len(entries)
        log.info("event=kernel_preload kernels=%d of=%d cached=%d precompiled=%d seconds=%.1f", done, len(entries),
                 len(cached), compiled, seconds)
        return done, seconds

    return _preloads.start(file, run)


_preloads = OncePerKey("kernel-preload")  # by manifest file: the loader's and the engine's call share one
