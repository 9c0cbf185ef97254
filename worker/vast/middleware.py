"""The aiohttp side: `vast_middleware` hands Vast-routed requests on our own routes to `app[VAST_APP_KEY]`, and the
OpenAI handlers read the unwrapped payload through `openai_body(request)` (it sits in `request[OPENAI_BODY]`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from worker.vast.envelope import OPENAI_BODY, VAST_REQUEST
from worker.vast.worker import VastWorker

VAST_APP_KEY: web.AppKey[VastWorker] = web.AppKey("glmflash_vast", VastWorker)


@web.middleware
async def vast_middleware(request: web.Request, handler):
    """Unwraps and admits Vast-routed requests on `VastConfig.routes` when `app[VAST_APP_KEY]` is set; anything
    else passes through untouched. Place it first (outside the error-mapping middleware) so it sees final statuses."""
    vast = request.app.get(VAST_APP_KEY)
    if vast is None or request.method != "POST" or request.path not in vast.config.routes:
        return await handler(request)
    return await vast.handle(request, handler)


async def openai_body(request: web.Request) -> Any:
    """The OpenAI body to serve: the unwrapped Vast payload, else the request's own JSON (may raise
    json.JSONDecodeError / UnicodeDecodeError, as `request.json()` does)."""
    if OPENAI_BODY in request:
        return request[OPENAI_BODY]
    return await request.json()


def vast_verified(request: web.Request) -> bool:
    """True for a request Vast's router signed and we verified (not merely UNSECURED); the bearer check can skip
    it, because Vast's client sends the *endpoint's* API key as its bearer."""
    record = request.get(VAST_REQUEST)
    return record is not None and record.verified
