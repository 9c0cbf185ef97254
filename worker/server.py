"""The aiohttp application: OpenAI routes, health and readiness, metrics, auth and error mapping."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web

from engine.scheduler import QueueFull
from provision.stages import StageClock
from worker.lifecycle import Lifecycle
from worker.metrics import Metrics
from worker.protocol import ModelCard, ModelList, ProtocolError, error_body
from worker.served_model import ServedModel
from worker.serving import STATE, ClientGone
from worker.serving_chat import chat_completions
from worker.serving_completion import completions
from worker.serving_tokenize import detokenize, tokenize
from worker.settings import Settings
from worker.vast import VAST_APP_KEY, VastWorker, vast_middleware, vast_verified

log = logging.getLogger("glmflash.worker")
OPEN_PATHS = ("/health", "/ready", "/metrics", "/idle")


@dataclass
class ServerState:
    settings: Settings
    clock: StageClock = field(default_factory=lambda: StageClock(300.0))
    metrics: Metrics = field(default_factory=Metrics)
    model: ServedModel | None = None
    lifecycle: Lifecycle | None = None
    vast: VastWorker | None = None  # set under Vast's serverless controller

    @property
    def stage(self) -> str:
        return self.clock.name

    def require_model(self) -> ServedModel:
        """The model, if new work may start now (not while loading, draining or parking)."""
        if self.model is None or self.stage != "ready":
            raise ProtocolError(f"not accepting requests (stage: {self.stage})", status=503, code="not_ready")
        return self.model


def build_app(state: ServerState) -> web.Application:
    # Vast outermost, so its load and status reports see every request's final status.
    app = web.Application(middlewares=[vast_middleware, _errors, _auth], client_max_size=64 << 20)
    app[STATE] = state
    if state.vast is not None:
        app[VAST_APP_KEY] = state.vast
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/idle", idle)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app


def _json_error(status: int, message: str, **fields) -> web.Response:
    return web.json_response(error_body(status, message, **fields), status=status)


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[STATE].settings.api_key
    if key and request.path not in OPEN_PATHS and not vast_verified(request):  # Vast's router signed it
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return _json_error(401, "Missing or invalid API key (expected 'Authorization: Bearer <key>').",
                               code="invalid_api_key")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler):
    """Map failures to OpenAI error bodies and count every request by route and status."""
    state: ServerState = request.app[STATE]
    resource = request.match_info.route.resource
    status = 500
    if state.lifecycle is not None:
        state.lifecycle.touch()
    try:
        response = await handler(request)
        status = response.status
        return response
    except (ProtocolError, QueueFull) as exc:
        if isinstance(exc, QueueFull):  # the engine refused it after admission raced another request
            exc = ProtocolError("The server is at capacity; retry shortly.", status=429, code="queue_full")
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
        if state.lifecycle is not None:
            state.lifecycle.touch()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 only when the model is loaded (with ready_at=partial: all but the routed experts) and warmed up;
    otherwise 503 with the stage and its progress."""
    state: ServerState = request.app[STATE]
    body = {"status": state.stage, **state.clock.status()}
    if state.model is not None:
        stats = state.model.engine.stats
        body.update(model=state.model.name, running=stats.running, waiting=stats.waiting)
        experts = state.model.experts
        if experts is not None:  # ready_at=partial: share of the routed experts' bytes in place, or "failed"
            body["experts_loaded"] = "failed" if experts.fill_error is not None else round(experts.share, 4)
    if state.lifecycle is not None:
        body.update(state.lifecycle.snapshot())
    return web.json_response(body, status=200 if state.stage == "ready" else 503)


async def idle(request: web.Request) -> web.Response:
    """In-flight work and idle seconds, for inactivity controllers that poll."""
    state: ServerState = request.app[STATE]
    body = state.lifecycle.snapshot() if state.lifecycle is not None else {"in_flight": 0, "idle_s": 0.0}
    return web.json_response({"stage": state.stage, **body})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    if state.model is not None:
        state.metrics.observe_engine(state.model.engine.stats)
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    model = state.require_model()
    card = ModelCard(id=model.name, max_model_len=model.max_model_len, root=model.name,
                     input_modalities=model.input_modalities)
    return web.json_response(text=ModelList(data=[card]).model_dump_json())
