"""`glmflash boot` / `glmflash serve`: the worker's life from container start to exit, top to bottom.

Listen at once (so /health answers and /ready reports the stage), provision and load by the
cheapest valid path, warm up, report ready, serve until SIGTERM or the idle timeout, drain, exit 0.
After a cold start the prepared snapshot is written in the background while serving (parking
waits for it; SIGTERM abandons it after the drain). With ready_at=partial the server is ready before the
routed experts are all in (worker.partial_ready).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Sequence

from aiohttp import web

from engine.sampler import LogitsProcessor
from provision.stages import StageClock
from worker.lifecycle import Lifecycle
from worker.provisioning import BackgroundPrepare, cpu_workers, provision_and_load
from worker.served_model import ServedModel, build_served_model, warm_up
from worker.server import ServerState, build_app
from worker.settings import Settings
from worker.partial_ready import ExpertFill, reduced_max_perf
from worker.vast import (VastWorker, benchmark_key, cached_max_perf, engine_generate_fn, measure_max_perf_within,
                         read_cached_max_perf)
from engine.loading import engine_version

log = logging.getLogger("glmflash.worker")


class CannotListen(Exception):
    """The server's address could not be bound (say, another server holds the port)."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host, self.port, self.reason = host, port, reason


async def serve(settings: Settings, stop: asyncio.Event | None = None,
                logits_processors: Sequence[LogitsProcessor] = ()) -> str:
    """Run the worker until stopped; returns why it stopped ("signal", "idle", or "stopped")."""
    state = ServerState(settings, StageClock(settings.start_window_s), vast=VastWorker.from_settings(settings))
    stop = stop or _stop_on_signals(state)
    state.lifecycle = lifecycle = Lifecycle(lambda: state.model.engine.num_requests if state.model else 0,
                                            settings.idle_timeout_s, settings.controller_url,
                                            settings.container_id or "glmflash")
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    ssl_context = state.vast.ssl_context() if state.vast else None
    try:
        await web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context).start()
    except OSError as error:  # a busy port, a host this machine does not have: the user's to fix, no traceback
        await runner.cleanup()
        raise CannotListen(settings.host, settings.port, error.strerror or str(error)) from None
    url = f"http://{settings.host}:{settings.port}"
    log.info("event=listening url=%s vast=%s", url, state.vast is not None)
    if state.vast:
        await state.vast.start()
    prepare: BackgroundPrepare | None = None
    fill: ExpertFill | None = None
    after_fill: asyncio.Task | None = None
    try:
        loaded = await asyncio.to_thread(provision_and_load, settings, state.clock)
        if loaded.experts is not None:  # ready_at=partial: the routed experts fill in from now, while the engine
            fill = ExpertFill(loaded.experts, settings.download_workers, settings.expert_fill_gbps)  # is built
            fill.start()
        model = build_served_model(loaded, settings)
        model.logits_processors = tuple(logits_processors)
        state.model = model
        model.engine.start()
        state.clock.stage("warmup")
        await warm_up(model)
        max_perf = None
        if state.vast:
            state.clock.stage("benchmark")
            max_perf = await (_vast_max_perf(settings, model) if fill is None else _partial_max_perf(settings, model))
        if loaded.prepare is not None:  # a cold start: the next one reads this back (fast_resume)
            prepare = BackgroundPrepare(loaded.prepare, cpu_workers(settings), state.clock,
                                        on_done=lambda: _release_swaps(model),
                                        busy=lambda: model.engine.num_requests > 0,
                                        busy_bytes_per_s=settings.prepare_busy_mb_s * 1e6)
        state.clock.stage("ready", url=f"{url}/v1", model=model.name,
                          **({"prepared_snapshot": "writing" if fill is None else "after_experts"}
                             if prepare is not None else {}),
                          **({"experts_loaded": round(model.experts.share, 4)} if fill is not None else {}))
        print(f"ready url={url}/v1 model={model.name}", flush=True)
        if state.vast and max_perf is not None:
            await state.vast.mark_loaded(max_perf)
        if fill is not None:
            after_fill = asyncio.create_task(_after_fill(fill, state, settings, prepare, max_perf is not None))
        elif prepare is not None:
            prepare.start()
        watcher = asyncio.create_task(lifecycle.watch(stop, lambda: state.stage))
        await stop.wait()
        reason = lifecycle.stop_reason or getattr(stop, "reason", "stopped")
        state.clock.stage("parking" if reason == "idle" else "draining")
        stopping = time.monotonic()
        aborted = await lifecycle.drain(settings.drain_grace_s, model.engine.abort_all)
        if after_fill is not None and reason == "idle":  # parking keeps the volume: the fill, then the write
            await asyncio.shield(after_fill)
        if prepare is not None:  # parking keeps the volume: finish, so the next start is fast; a stop: what
            # the grace has left (the rest is resumed next time)
            left = max(0.0, settings.drain_grace_s - (time.monotonic() - stopping))
            await asyncio.to_thread(prepare.stop, None if reason == "idle" else left)
        state.clock.stage("stopped", reason=reason, aborted=aborted)
        watcher.cancel()
        return reason
    except Exception as exc:
        if state.vast:  # the autoscaler hears the error before the process exits
            await state.vast.report_fatal(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if after_fill is not None:
            after_fill.cancel()
        if fill is not None:
            fill.stop()
        if prepare is not None:
            await asyncio.to_thread(prepare.stop, 0.0)
        if state.model is not None:
            await state.model.engine.shutdown()
        if state.vast:
            await state.vast.stop()
        await runner.cleanup()


async def _after_fill(fill: ExpertFill, state: ServerState, settings: Settings, prepare: BackgroundPrepare | None,
                      vast_loaded: bool) -> None:
    """Once every expert is in: the prepared snapshot write, and Vast's full max_perf."""
    error = await fill.finished
    if error is not None:  # /ready shows experts_loaded=failed
        if state.vast:
            state.vast.mark_errored(f"expert fill failed: {type(error).__name__}: {error}")
        return
    if prepare is not None:
        state.clock.progress(prepared_snapshot="writing")
        prepare.start()
    if state.vast:
        full = await _vast_max_perf(settings, state.model)
        if vast_loaded:
            state.vast.update_max_perf(full)
        else:
            await state.vast.mark_loaded(full)


def _release_swaps(model: ServedModel) -> None:
    """Experts may move between device slots and the host bank again (the prepared snapshot is done)."""
    offload = model.engine.core.offload
    if offload is not None:
        offload.swaps_held = False


def _benchmark_file(settings: Settings) -> Path:
    """Where the startup benchmark's figure is cached, per model, engine and settings (the key)."""
    return settings.cache_dir / "vast_benchmark.json"


def _benchmark_key(settings: Settings, model: ServedModel) -> dict:
    return benchmark_key(model=model.name, revision=settings.model_revision, engine_version=engine_version(),
                         device=settings.resolved_device(), dtype=settings.resolved_dtype(),
                         max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                         budget_s=settings.vast_benchmark_s)


async def _vast_max_perf(settings: Settings, model: ServedModel) -> float:
    """Workload units/s from real requests through the engine, cached per model, engine and settings."""
    max_perf, _ = await cached_max_perf(
        _benchmark_file(settings), _benchmark_key(settings, model),
        lambda: measure_max_perf_within(engine_generate_fn(model), settings.vast_benchmark_s, 3, settings.max_num_seqs))
    return max_perf


async def _partial_max_perf(settings: Settings, model: ServedModel) -> float | None:
    """While experts are missing: the cached full figure, reduced (partial_ready); None when nothing is cached
    (a benchmark now would measure the fill, not the engine)."""
    full = read_cached_max_perf(_benchmark_file(settings), _benchmark_key(settings, model))
    return None if full is None else reduced_max_perf(full, model.experts.share)


def _stop_on_signals(state: ServerState) -> asyncio.Event:
    """SIGTERM/SIGINT: drain when serving; before ready nothing is in flight, so exit at once
    (downloads resume and a prepared snapshot only counts once its plan is written)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def handle(sig: signal.Signals) -> None:
        if state.stage != "ready":
            print(f"PROVISION_STAGE=stopped reason={sig.name} during={state.stage}", flush=True)
            os._exit(0)
        stop.reason = "signal"  # type: ignore[attr-defined]
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)
    return stop
