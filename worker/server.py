"""The aiohttp application: OpenAI routes, health and readiness, metrics, auth and error mapping."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from provision.settings import Settings
from worker.metrics import Metrics
from worker.protocol import ModelCard, ModelList, ProtocolError, error_body
from worker.served_model import ServedModel
from worker.serving import ClientGone
from worker.serving_chat import chat_completions
from worker.serving_completion import completions

log = logging.getLogger("glmflash.worker")
OPEN_PATHS = ("/health", "/ready", "/metrics")


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    stage: str = "starting"  # starting -> loading -> warmup -> ready -> draining
    model: ServedModel | None = None
    started: float = field(default_factory=time.monotonic)

    def require_model(self) -> ServedModel:
        if self.model is None or self.stage not in ("ready", "warmup"):
            raise ProtocolError(f"the model is not ready (stage: {self.stage})", status=503, code="not_ready")
        return self.model


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=64 << 20)
    app["state"] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app


def _json_error(status: int, message: str, **fields) -> web.Response:
    return web.json_response(error_body(status, message, **fields), status=status)


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app["state"].settings.api_key
    if key and request.path not in OPEN_PATHS:
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return _json_error(401, "Missing or invalid API key (expected 'Authorization: Bearer <key>').",
                               code="invalid_api_key")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Map failures to OpenAI error bodies and count every request by route and status."""
    state: ServerState = request.app["state"]
    resource = request.match_info.route.resource
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except ProtocolError as exc:
        status = exc.status
        response = web.json_response(exc.body(), status=exc.status)
        if exc.status == 429:
            state.metrics.rejected.inc()
            response.headers["Retry-After"] = "1"
        return response
    except web.HTTPException as exc:
        status = exc.status
        return _json_error(exc.status, exc.reason)
    except (ClientGone, ConnectionError, asyncio.CancelledError) as exc:
        status = 499  # the client left; its engine requests were aborted on the way out
        state.metrics.aborted.inc()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return web.Response(status=499)
    except Exception as exc:
        log.exception("event=request_failed path=%s", request.path)
        return _json_error(500, f"internal error: {exc}")
    finally:
        state.metrics.requests.labels(resource.canonical if resource else "unmatched", str(status)).inc()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = {"status": state.stage, "uptime_s": round(time.monotonic() - state.started, 3)}
    if state.model is not None:
        stats = state.model.engine.stats
        body.update(model=state.model.name, running=stats.running, waiting=stats.waiting)
    return web.json_response(body, status=200 if state.stage == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    if state.model is not None:
        state.metrics.observe_engine(state.model.engine.stats)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    model = state.require_model()
    card = ModelCard(id=model.name, max_model_len=model.max_model_len, root=model.name)
    return web.json_response(text=ModelList(data=[card]).model_dump_json())
