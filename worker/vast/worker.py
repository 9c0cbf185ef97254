"""`VastWorker`: a running server's side of Vast, its lifecycle (reporting, the router's public key, loaded /
errored) and the admission of each routed request.

**Requests** (`backend.py` `Backend.__handle_request`): the body is `{auth_data, payload, session_id}`; a bad
shape is 422, a bad signature 401 (skipped when UNSECURED=true), an in-flight workload / max_perf above
`max_queue_time` is 429, a client that leaves is 499 / "Cancelled".
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from worker.protocol import error_body
from worker.vast.config import VastConfig
from worker.vast.envelope import OPENAI_BODY, VAST_REQUEST, AuthData, EnvelopeError, parse_envelope
from worker.vast.reporter import HTTP_TIMEOUT_S, RequestRecord, VastReporter
from worker.vast.signing import load_public_key, verify_signature
from worker.vast.tls import INSTANCE_CERT, INSTANCE_KEY, server_ssl_context
from worker.vast.workload import workload_of

log = logging.getLogger("glmflash.vast")

PUBKEY_BACKOFF_CAP_S = 16.0  # backend.py: 5 attempts, backoff 1, 2, 4, 8 s, then the worker errors
PUBKEY_WAIT_S = 60.0  # backend.py waits this long for the key before marking the model loaded
PUBKEY_FAILED = "Failed to get Serverless public key after all retry attempts"  # backend.py's error_msg


class VastWorker:
    """Everything Vast needs from a running server: `start()`, `mark_loaded()`, `vast_middleware`, `stop()`."""

    def __init__(self, config: VastConfig, *, load_started_at: float | None = None, disk_path: str = "/",
                 clock: Callable[[], float] = time.time, pubkey_attempts: int | None = None,
                 pubkey_backoff_s: float = 1.0) -> None:
        self.config = config
        self.clock = clock
        self.reporter = VastReporter(config, load_started_at=load_started_at, disk_path=disk_path, clock=clock)
        self.pubkey: rsa.RSAPublicKey | None = None
        self.pubkey_attempts, self.pubkey_backoff_s = pubkey_attempts, pubkey_backoff_s
        self._pubkey_done = asyncio.Event()
        self._pubkey_task: asyncio.Task | None = None
        self._warned_url = False

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None,
                      **kwargs: Any) -> "VastWorker | None":
        config = VastConfig.from_settings(settings, environ)
        return None if config is None else cls(config, **kwargs)

    # lifecycle ------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin reporting ("loading") and fetching the router's public key; call once the port listens."""
        log.info("event=vast_start url=%s report_addr=%s unsecured=%s", self.config.url,
                 ",".join(self.config.report_addrs), self.config.unsecured)
        self.reporter.start()
        if self.config.unsecured:
            self._pubkey_done.set()
        elif self._pubkey_task is None:
            self._pubkey_task = asyncio.create_task(self.fetch_pubkey(), name="vast-pubkey")

    async def fetch_pubkey(self) -> bool:
        """GET {REPORT_ADDR}/pubkey/ with backoff 1, 2, 4 ... 16 s (backend.py _fetch_pubkey). The framework gives up
        after 5 attempts (~15 s) and errors the worker; by default this keeps trying while the model loads, and
        `mark_loaded` errors the worker if the key has not come PUBKEY_WAIT_S after loading."""
        session = await self.reporter.http()
        attempt = 0
        try:
            while self.pubkey_attempts is None or attempt < self.pubkey_attempts:
                attempt += 1
                for addr in self.config.report_addrs:
                    try:
                        async with session.get(addr.rstrip("/") + "/pubkey/") as response:
                            response.raise_for_status()
                            self.pubkey = load_public_key(await response.text())
                        log.info("event=vast_pubkey addr=%s attempt=%d", addr, attempt)
                        return True
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                        log.warning("event=vast_pubkey_failed addr=%s attempt=%d error=%r", addr, attempt, exc)
                if self.pubkey_attempts is None or attempt < self.pubkey_attempts:
                    await asyncio.sleep(min(self.pubkey_backoff_s * 2 ** min(attempt - 1, 10), PUBKEY_BACKOFF_CAP_S))
            self.reporter.model_errored(PUBKEY_FAILED)
            return False
        finally:
            self._pubkey_done.set()

    async def mark_loaded(self, max_perf: float, pubkey_wait_s: float = PUBKEY_WAIT_S) -> bool:
        """Report "loaded" with the benchmark figure, at once. Waits for the public key first (a worker without it
        could only answer 401); False, and the worker errored, if it never came."""
        if not self.config.unsecured:
            try:
                await asyncio.wait_for(self._pubkey_done.wait(), pubkey_wait_s)
            except asyncio.TimeoutError:
                self.reporter.model_errored(PUBKEY_FAILED)
                return False
            if self.pubkey is None:
                return False
        self.reporter.model_loaded(max_perf)
        return True

    def update_max_perf(self, max_perf: float) -> None:
        """Report a new max_perf for a worker already loaded (early readiness: the reduced one was reported)."""
        self.reporter.max_perf_changed(max_perf)

    def mark_errored(self, message: str) -> None:
        self.reporter.model_errored(message)

    async def report_fatal(self, message: str, timeout: float = HTTP_TIMEOUT_S) -> bool:
        """Error the worker and wait (bounded) until the autoscaler has heard it, before the process exits."""
        self.reporter.start()
        self.reporter.model_errored(message)
        return await self.reporter.flush(timeout)

    async def stop(self) -> None:
        if self._pubkey_task is not None:
            self._pubkey_task.cancel()
            await asyncio.gather(self._pubkey_task, return_exceptions=True)
        await self.reporter.stop()

    def ssl_context(self, cert: Path = INSTANCE_CERT, key: Path = INSTANCE_KEY) -> ssl.SSLContext | None:
        """For the listening site when USE_SSL=true: /etc/instance.crt and .key (lib/server.py); None otherwise."""
        return server_ssl_context(cert, key) if self.config.use_ssl else None

    # requests -------------------------------------------------------------------------------------------------

    def verify(self, auth: AuthData) -> bool:
        if self.config.unsecured:
            return True
        if self.pubkey is None:
            log.error("event=vast_reject reason=pubkey_not_loaded")
            return False
        if not verify_signature(self.pubkey, auth.url, auth.signature):
            return False
        if auth.url != self.config.url and not self._warned_url:  # accepted, as by the framework (url-only check)
            self._warned_url = True
            log.warning("event=vast_url_mismatch signed_url=%s reported_url=%s", auth.url, self.config.url)
        return True

    async def handle(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        raw = await request.read()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict) or "auth_data" not in data:
            if not self.config.allow_plain_requests:
                return _error(401, "This worker serves requests routed by Vast ({auth_data, payload}); "
                                   "set an API key or UNSECURED=true to accept plain OpenAI requests.",
                              code="vast_auth_required")
            if data is not None:
                request[OPENAI_BODY] = data
            return await handler(request)
        try:
            auth, payload, session_id = parse_envelope(data)
        except EnvelopeError as exc:
            return web.json_response(exc.errors, status=422)
        if session_id is not None:
            return web.json_response({"error": "invalid session"}, status=410)  # no sessions here (backend.py)
        record = RequestRecord(request_idx=auth.request_idx, reqnum=auth.reqnum, entered_queue_at=self.clock(),
                               workload=workload_of(payload, default_max_tokens=self.config.default_max_tokens))
        reporter = self.reporter
        if not self.verify(auth):
            reporter.request_rejected(record)
            log.warning("event=vast_reject reason=signature request_idx=%s", auth.request_idx)
            return _error(401, "Invalid Vast route signature.", code="invalid_signature")
        record.verified = not self.config.unsecured
        if reporter.wait_time > self.config.max_queue_time:
            reporter.request_rejected(record)
            response = _error(429, f"Queue time {reporter.wait_time:.1f}s exceeds {self.config.max_queue_time:g}s; "
                                   "retry on another worker.", code="queue_time_exceeded")
            response.headers["Retry-After"] = "1"
            return response
        request[OPENAI_BODY] = payload
        request[VAST_REQUEST] = record
        reporter.request_started(record)
        status = "Error"
        try:
            response = await handler(request)
            status = outcome_of(response.status)
            return response
        except (asyncio.CancelledError, ConnectionError):  # handler_cancellation: the client went away
            status = "Cancelled"
            raise
        except Exception as exc:  # HTTPException / ProtocolError carry a status (placed inside _errors)
            code = getattr(exc, "status", None)
            status = outcome_of(code) if isinstance(code, int) else "Error"
            raise
        finally:
            reporter.request_finished(record, status)


def outcome_of(http_status: int) -> str:
    """How a finished request counts: 499 Cancelled, 429 Rejected (the engine's queue), 5xx Error, else Success
    (a 4xx is a served answer, as a model's 4xx is for the framework)."""
    if http_status == 499:
        return "Cancelled"
    if http_status == 429:
        return "Rejected"
    return "Error" if http_status >= 500 else "Success"


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(error_body(status, message, code=code), status=status)
