"""The startup benchmark behind `max_perf`.

**Benchmark** (`Backend.__run_benchmark`): max over rounds of (workload of the successful requests / round wall
time), cached in `.has_benchmark` forever. `measure_max_perf` does the same through our engine with a realistic
payload, `measure_max_perf_within` bounds it in time (sized from a short first round, so a slow machine
reports `loaded` within seconds, not minutes), and `cached_max_perf` keys the cache by model, engine version and
benchmark definition.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from worker.vast.workload import CHARS_PER_TOKEN, workload_of

log = logging.getLogger("glmflash.vast")

BENCHMARK_VERSION = 2  # bump when the payload or the workload definition changes (invalidates every cache)
BENCHMARK_PROMPT_UNITS = 384
BENCHMARK_MAX_TOKENS = 256
_WORDS = ("the request queue holds pending work while the scheduler batches decode steps across active sequences "
          "and prefill chunks arrive from new prompts expert weights stream from host memory into the device "
          "cache when the router selects them each layer reads its state slot writes new keys and returns "
          "logits for sampling a summary should mention throughput latency memory pressure and failure "
          "handling in plain words for an operator reading the report after an incident review").split()


class BenchmarkFailed(RuntimeError):
    """No benchmark request succeeded (the framework errors the worker then)."""


def benchmark_payload(index: int, *, prompt_units: int = BENCHMARK_PROMPT_UNITS,
                      max_tokens: int = BENCHMARK_MAX_TOKENS) -> dict[str, Any]:
    """A /v1/completions body that looks like traffic: a ~`prompt_units`-unit prompt (4 chars a unit), different
    per index (no shared prefix to cache), and `max_tokens` generated in full (`ignore_eos`), not 16."""
    rng = random.Random(index)
    text = f"Report {index}. Summarize these notes for the on-call operator:\n"
    while len(text) < prompt_units * CHARS_PER_TOKEN:
        text += " ".join(rng.choice(_WORDS) for _ in range(12)) + ".\n"
    text = text[:prompt_units * CHARS_PER_TOKEN - 9] + "\nSummary:"
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def _round(generate_fn: Callable[[dict[str, Any]], Awaitable[Any]], payloads: list[dict[str, Any]],
                 run: int) -> float:
    """One round of concurrent requests -> workload units/s of its successful ones over its wall time."""
    start = time.perf_counter()
    results = await asyncio.gather(*(generate_fn(p) for p in payloads), return_exceptions=True)
    elapsed = time.perf_counter() - start
    failed = [r for r in results if isinstance(r, BaseException)]
    done = sum(workload_of(p) for p, r in zip(payloads, results) if not isinstance(r, BaseException))
    if not done:
        raise BenchmarkFailed(f"no successful benchmark request in round {run}: {failed[0]!r}")
    perf = done / elapsed
    log.info("event=vast_benchmark_round run=%d concurrency=%d workload=%.0f elapsed_s=%.3f perf=%.2f failed=%d",
             run, len(payloads), done, elapsed, perf, len(failed))
    return perf


async def measure_max_perf(generate_fn: Callable[[dict[str, Any]], Awaitable[Any]], runs: int = 3,
                           concurrency: int = 8, *, payload_fn: Callable[[int], dict[str, Any]] = benchmark_payload,
                           warmup: bool = False) -> float:
    """Throughput in workload units/s, as backend.py `__run_benchmark` measures it: `runs` rounds of `concurrency`
    concurrent requests through `generate_fn` (our engine path; it returns when a request is done and raises when
    it failed); a round's figure is the workload of its successful requests / its wall time; the result is the best
    round. Use concurrency = the engine's slots (max_num_seqs). Raises BenchmarkFailed if a round had no success.
    `warmup` runs one request first (the server's warm_up usually did that already)."""
    if runs < 1 or concurrency < 1:
        raise ValueError("runs and concurrency must be >= 1")
    if warmup:
        await generate_fn(payload_fn(-1))
    perfs = [await _round(generate_fn, [payload_fn((run - 1) * concurrency + i) for i in range(concurrency)], run)
             for run in range(1, runs + 1)]
    log.info("event=vast_benchmark max_perf=%.2f mean_perf=%.2f", max(perfs), sum(perfs) / runs)
    return max(perfs)


PROBE_PROMPT_UNITS, PROBE_MAX_TOKENS = 32, 16  # the first, short round that sizes the others


async def measure_max_perf_within(generate_fn: Callable[[dict[str, Any]], Awaitable[Any]], budget_s: float,
                                  runs: int = 3, concurrency: int = 8) -> float:
    """measure_max_perf bounded in time: a short probe round (small prompts, 16 tokens) measures the machine,
    then up to `runs` rounds of the realistic payload, shrunk so that they fit what is left of `budget_s`
    (never below the probe's size), stop once the next would overrun. The best round, the probe included."""
    if runs < 1 or concurrency < 1 or budget_s <= 0:
        raise ValueError("runs, concurrency and budget_s must be positive")
    start = time.perf_counter()
    index = 0

    def payloads(prompt_units: int, max_tokens: int) -> list[dict[str, Any]]:
        nonlocal index
        index += concurrency
        return [benchmark_payload(index - concurrency + i, prompt_units=prompt_units, max_tokens=max_tokens)
                for i in range(concurrency)]

    perfs = [await _round(generate_fn, payloads(PROBE_PROMPT_UNITS, PROBE_MAX_TOKENS), 0)]
    left = budget_s - (time.perf_counter() - start)
    full = BENCHMARK_PROMPT_UNITS + BENCHMARK_MAX_TOKENS
    scale = min(1.0, left / runs * perfs[0] / (concurrency * full))  # of the realistic payload, per round
    prompt_units = max(PROBE_PROMPT_UNITS, int(BENCHMARK_PROMPT_UNITS * scale))
    max_tokens = max(PROBE_MAX_TOKENS, int(BENCHMARK_MAX_TOKENS * scale))
    round_s = concurrency * (prompt_units + max_tokens) / perfs[0]  # as the probe predicts it
    for run in range(1, runs + 1):
        if time.perf_counter() - start + round_s > budget_s:
            break
        perfs.append(await _round(generate_fn, payloads(prompt_units, max_tokens), run))
    log.info("event=vast_benchmark max_perf=%.2f rounds=%d prompt_units=%d max_tokens=%d seconds=%.2f",
             max(perfs), len(perfs) - 1, prompt_units, max_tokens, time.perf_counter() - start)
    return max(perfs)


def benchmark_key(*, model: str, revision: str | None, engine_version: str, **extra: Any) -> dict[str, Any]:
    """What a cached max_perf depends on. Pass in `extra` whatever else changes throughput (GPU name and count,
    max_num_seqs, dtype, max_num_batched_tokens, the benchmark's runs / concurrency)."""
    return {"benchmark_version": BENCHMARK_VERSION, "model": model, "revision": revision,
            "engine_version": engine_version, **{k: extra[k] for k in sorted(extra)}}


def _key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def read_cached_max_perf(path: Path, key: Mapping[str, Any]) -> float | None:
    """The cached max_perf for exactly this key, or None (none, another key's, or a cache that cannot be read)."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("digest") == _key_digest(key) and float(cached["max_perf"]) > 0:
            log.info("event=vast_benchmark_cached max_perf=%.2f path=%s", float(cached["max_perf"]), path)
            return float(cached["max_perf"])
        log.info("event=vast_benchmark_stale path=%s", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("event=vast_benchmark_cache_unreadable path=%s error=%r", path, exc)
    return None


async def cached_max_perf(path: Path, key: Mapping[str, Any], measure: Callable[[], Awaitable[float]]
                          ) -> tuple[float, bool]:
    """(max_perf, came from the cache). The cache file (JSON, under /workspace so it outlives a stop) is used only
    when its key matches exactly; otherwise `measure()` runs and replaces it. A cache that cannot be read or
    written is logged and ignored."""
    cached = read_cached_max_perf(path, key)
    if cached is not None:
        return cached, True
    digest = _key_digest(key)
    perf = await measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"digest": digest, "key": dict(key), "max_perf": perf,
                                   "measured_at": time.time()}, indent=2, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("event=vast_benchmark_cache_unwritable path=%s error=%r", path, exc)
    return perf, False


def engine_generate_fn(model: Any) -> Callable[[dict[str, Any]], Awaitable[int]]:
    """`generate_fn` for measure_max_perf over a worker.served_model.ServedModel: tokenize the completion prompt and
    drain the engine stream (what /v1/completions does, minus HTTP). Returns the tokens generated."""
    from engine.sampling_params import SamplingParams

    async def generate(body: dict[str, Any]) -> int:
        params = SamplingParams(max_tokens=int(body["max_tokens"]), temperature=float(body.get("temperature", 0.0)),
                                ignore_eos=bool(body.get("ignore_eos", True)))
        stream = await model.engine.generate(model.encode(body["prompt"]), params)
        count = 0
        async for delta in stream:
            count += len(delta.token_ids)
        return count

    return generate
