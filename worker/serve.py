"""`glmflash serve`: listen at once, load the model, warm it up, then report ready; stop on SIGTERM/SIGINT.

The HTTP server is up before the model so /health answers and /ready reports the loading stage.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Sequence

from aiohttp import web

from engine.sampler import LogitsProcessor
from engine.tiny.factory import write_tiny_model
from provision.settings import Settings
from worker.served_model import load_served_model, warm_up
from worker.server import ServerState, build_app

log = logging.getLogger("glmflash.worker")
TINY_NAME = "glmflash-tiny"


def resolve_model(settings: Settings) -> tuple[Path, str]:
    """(snapshot directory, served name). No model: the embedded tiny model, written on first use."""
    if settings.model is None:
        path = settings.cache_dir / "tiny-glm5-next"
        if not (path / "model.safetensors.index.json").exists():
            write_tiny_model(path)
            log.info("event=tiny_model_written path=%s", path)
        return path, settings.served_model_name or TINY_NAME
    path = Path(settings.model)
    if path.is_dir():
        return path, settings.served_model_name or path.name
    from huggingface_hub import snapshot_download

    repo, _, revision = settings.model.partition("@")
    local = snapshot_download(repo, revision=revision or None, token=settings.hf_token,
                              cache_dir=str(settings.cache_dir / "hub"))
    return Path(local), settings.served_model_name or repo


async def serve(settings: Settings, stop: asyncio.Event | None = None,
                logits_processors: Sequence[LogitsProcessor] = ()) -> None:
    stop = stop or _stop_on_signals()
    state = ServerState(settings)
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    url = f"http://{settings.host}:{settings.port}"
    log.info("event=listening url=%s", url)
    try:
        state.stage = "loading"
        snapshot, name = resolve_model(settings)
        model = await asyncio.to_thread(load_served_model, snapshot, settings, name)
        model.logits_processors = tuple(logits_processors)
        state.model = model
        model.engine.start()
        state.stage = "warmup"
        await warm_up(model)
        state.stage = "ready"
        print(f"ready url={url}/v1 model={name}", flush=True)
        await stop.wait()
    finally:
        state.stage = "stopping"
        if state.model is not None:
            await state.model.engine.shutdown()
        await runner.cleanup()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
