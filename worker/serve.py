"""`glmflash boot` / `glmflash serve`: the worker's life from container start to exit, top to bottom.

Listen at once (so /health answers and /ready reports the stage), provision and load by the
cheapest valid path, warm up, report ready, serve until SIGTERM or the idle timeout, drain, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Sequence

from aiohttp import web

from engine.sampler import LogitsProcessor
from provision.settings import Settings
from provision.stages import StageClock
from worker.lifecycle import Lifecycle
from worker.provisioning import provision_and_load
from worker.served_model import build_served_model, warm_up
from worker.server import ServerState, build_app

log = logging.getLogger("glmflash.worker")


async def serve(settings: Settings, stop: asyncio.Event | None = None,
                logits_processors: Sequence[LogitsProcessor] = ()) -> str:
    """Run the worker until stopped; returns why it stopped ("signal", "idle", or "stopped")."""
    state = ServerState(settings, StageClock(settings.start_window_s))
    stop = stop or _stop_on_signals(state)
    state.lifecycle = lifecycle = Lifecycle(lambda: state.model.engine.num_requests if state.model else 0,
                                            settings.idle_timeout_s, settings.controller_url,
                                            settings.container_id or "glmflash")
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    url = f"http://{settings.host}:{settings.port}"
    log.info("event=listening url=%s", url)
    try:
        loaded = await asyncio.to_thread(provision_and_load, settings, state.clock)
        model = build_served_model(loaded, settings)
        model.logits_processors = tuple(logits_processors)
        state.model = model
        model.engine.start()
        state.clock.stage("warmup")
        await warm_up(model)
        state.clock.stage("ready", url=f"{url}/v1", model=model.name)
        print(f"ready url={url}/v1 model={model.name}", flush=True)
        watcher = asyncio.create_task(lifecycle.watch(stop, lambda: state.stage))
        await stop.wait()
        reason = lifecycle.stop_reason or getattr(stop, "reason", "stopped")
        state.clock.stage("parking" if reason == "idle" else "draining")
        aborted = await lifecycle.drain(settings.drain_grace_s, model.engine.abort_all)
        state.clock.stage("stopped", reason=reason, aborted=aborted)
        watcher.cancel()
        return reason
    finally:
        if state.model is not None:
            await state.model.engine.shutdown()
        await runner.cleanup()


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
