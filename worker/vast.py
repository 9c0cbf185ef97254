"""Vast.ai serverless, spoken natively by our aiohttp server (no PyWorker process, no proxy hop).

What the `vastai` package (1.9.1, `vastai/serverless/server/lib/`) does, and what this module does instead:

* **Status** (`metrics.py` `Metrics.__send_metrics_and_reset`): POST `{REPORT_ADDR}/worker_status/` with the fields
  of `data_types.WorkerStatusData`. The framework checks once a second and sends when an update is pending or 10 s
  went by, and does *not* mark an update pending when the model loads (a report lag of up to 10 s).
  `VastReporter` sends loaded / errored at once, then at most once a second while anything changed and every 10 s
  otherwise; counters are reduced by what a *delivered* report carried (nothing that happens during a send is lost);
  a failed send is retried with backoff and never raises into the server.
* **Finished requests** (`Metrics.__send_delete_requests_and_reset`): POST `{REPORT_ADDR}/delete_requests/` with
  `{worker_id, mtoken, requests: [{request_idx, success, status, entered_queue_at, work_started_at,
  work_completed_at}]}`; sent as soon as a request ends.
* **Requests** (`backend.py` `Backend.__handle_request`): the body is `{auth_data, payload, session_id}`; a bad
  shape is 422, a bad signature 401 (`__check_signature`: RSA PKCS#1 v1.5 / SHA-256 over
  `json.dumps({"url": auth_data.url}, indent=4, sort_keys=True)`; skipped when UNSECURED=true), an in-flight
  workload / max_perf above `max_queue_time` is 429, a client that leaves is 499 / "Cancelled".
  `vast_middleware` does the same on our own routes and hands the payload to the OpenAI handler through
  `request[OPENAI_BODY]` (read it with `openai_body(request)`).
* **Benchmark** (`Backend.__run_benchmark`): max over rounds of (workload of the successful requests / round wall
  time), cached in `.has_benchmark` forever. `measure_max_perf` does the same through our engine with a realistic
  payload, and `cached_max_perf` keys the cache by model, engine version and benchmark definition.

Workload units (one definition for admission, cur_load and the benchmark): see `workload_of`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import math
import os
import random
import shutil
import ssl
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from worker.protocol import error_body

log = logging.getLogger("glmflash.vast")

PROTOCOL_VERSION = "1.1.0"  # backend.VERSION, reported as `version`
DEFAULT_REPORT_ADDR = "https://run.vast.ai"
REDIS_REPORT_ADDR = "https://cloud.vast.ai/api/v0"  # metrics.py skips it for /delete_requests/
VAST_ROUTES = ("/v1/chat/completions", "/v1/completions")
# Request storage keys (web.RequestKey where aiohttp has it, else the plain string):
_RequestKey = getattr(web, "RequestKey", None)
OPENAI_BODY: Any = _RequestKey("openai_body", object) if _RequestKey else "openai_body"  # the body to serve
VAST_REQUEST: Any = _RequestKey("vast_request", object) if _RequestKey else "vast_request"  # its RequestRecord
DEFAULT_WORKLOAD = 100.0  # worker.py DEFAULT_WORKLOAD: what a body we cannot price counts
CHARS_PER_TOKEN = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (and ours)
STATUS_BUSY_INTERVAL_S = 1.0  # metrics.py METRICS_UPDATE_INTERVAL
STATUS_IDLE_INTERVAL_S = 10.0
HTTP_TIMEOUT_S = 10.0  # metrics.py ClientTimeout(total=10)
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 10.0)
PUBKEY_BACKOFF_CAP_S = 16.0  # backend.py: 5 attempts, backoff 1, 2, 4, 8 s, then the worker errors
PUBKEY_WAIT_S = 60.0  # backend.py waits this long for the key before marking the model loaded
PUBKEY_FAILED = "Failed to get Serverless public key after all retry attempts"  # backend.py's error_msg
SIGN_CERT_URL = "https://console.vast.ai/api/v0/sign_cert/"
INSTANCE_CERT, INSTANCE_KEY = Path("/etc/instance.crt"), Path("/etc/instance.key")


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


# --- workload units ----------------------------------------------------------------------------------------------


def _text_units(text: str, count_tokens: Callable[[str], int] | None) -> int:
    return count_tokens(text) if count_tokens else math.ceil(len(text) / CHARS_PER_TOKEN)


def _strings(value: Any) -> list[str]:
    """Every string leaf of a JSON value (message contents, text parts, tool-call names and arguments)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def workload_of(body: Any, *, default_max_tokens: int = 256,
                count_tokens: Callable[[str], int] | None = None) -> float:
    """Workload units of one OpenAI request: what Vast calls cost / load / perf, in tokens.

        workload = n x (prompt tokens + max_tokens), summed over the prompts of a /v1/completions batch

    * prompt tokens: exact for token-id prompts; for text, `count_tokens(text)` when given, else
      ceil(chars / 4) (a body is priced before it is tokenized). Chat counts the text of every message (string
      content, text parts, tool-call names and arguments) plus the JSON of `tools`.
    * max_tokens: `max_completion_tokens`, else `max_tokens`, else 16 for /v1/completions (OpenAI's default, and
      the server's) or `default_max_tokens` for chat (whose real cap is the rest of the context).

    The benchmark prices its requests with this same function, so `max_perf` (units/s), `cur_load` and the queue
    time estimate share one unit. A body it cannot read counts DEFAULT_WORKLOAD (100), as in the framework.
    """
    if not isinstance(body, dict):
        return DEFAULT_WORKLOAD
    n = _positive_int(body.get("n")) or 1
    limit = _positive_int(body.get("max_completion_tokens"))
    limit = limit if limit is not None else _positive_int(body.get("max_tokens"))
    if "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return DEFAULT_WORKLOAD
        text = "".join(_strings(messages))
        if body.get("tools"):
            text += json.dumps(body["tools"], separators=(",", ":"))
        prompts = [_text_units(text, count_tokens)]
        limit = default_max_tokens if limit is None else limit
    elif "prompt" in body:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [_text_units(prompt, count_tokens)]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [len(prompt)]
        elif isinstance(prompt, list) and prompt:
            prompts = []
            for item in prompt:
                if isinstance(item, str):
                    prompts.append(_text_units(item, count_tokens))
                elif isinstance(item, list):
                    prompts.append(len(item))
                else:
                    return DEFAULT_WORKLOAD
        else:
            return DEFAULT_WORKLOAD
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit
    else:
        return DEFAULT_WORKLOAD
    return float(n * sum(p + limit for p in prompts))


# --- signatures --------------------------------------------------------------------------------------------------


def load_public_key(text: str | bytes) -> rsa.RSAPublicKey:
    """The key served at `{REPORT_ADDR}/pubkey/`: PEM (SPKI or PKCS#1), DER or OpenSSH, as pycryptodome's
    `RSA.import_key` (the framework's parser) accepts."""
    data = text.strip().encode() if isinstance(text, str) else text.strip()
    loaders = (serialization.load_pem_public_key, serialization.load_der_public_key,
               serialization.load_ssh_public_key)
    for load in loaders:
        try:
            key = load(data)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
        if isinstance(key, rsa.RSAPublicKey):
            return key
        raise ValueError(f"the serverless public key is not an RSA key ({type(key).__name__})")
    raise ValueError("the serverless public key could not be parsed")


def signed_message(url: Any) -> bytes:
    """The bytes Vast's router signs: only the worker url (backend.py `__check_signature`), so the signature says
    "the router sent this to this worker" and nothing about the payload, cost or reqnum."""
    return json.dumps({"url": url}, indent=4, sort_keys=True).encode()


def verify_signature(key: rsa.RSAPublicKey, url: Any, signature: Any) -> bool:
    """RSA PKCS#1 v1.5 / SHA-256 of `signed_message(url)`, the signature base64 (as the framework checks it)."""
    try:
        raw = base64.b64decode(signature)
        key.verify(raw, signed_message(url), padding.PKCS1v15(), hashes.SHA256())
        return True
    except (InvalidSignature, binascii.Error, ValueError, TypeError):
        return False


# --- the request envelope ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthData:
    """The route reply the client forwards (data_types.AuthData); every field is required, as there."""

    cost: Any
    endpoint: Any
    reqnum: int
    request_idx: int
    signature: Any
    url: Any

    @classmethod
    def parse(cls, value: Any) -> "AuthData":
        if not isinstance(value, dict):
            raise EnvelopeError({"auth_data": "must be an object"})
        errors = {name: "missing parameter" for name in cls.__dataclass_fields__ if name not in value}
        ints: dict[str, int] = {}
        for name in ("reqnum", "request_idx"):
            if name in value:
                try:
                    ints[name] = int(value[name])
                except (TypeError, ValueError):
                    errors[name] = "must be an integer"
        if errors:
            raise EnvelopeError({"auth_data": errors})
        return cls(cost=value["cost"], endpoint=value["endpoint"], signature=value["signature"], url=value["url"],
                   **ints)


class EnvelopeError(Exception):
    """A malformed `{auth_data, payload}` body: 422 with the framework's error dict as the body."""

    def __init__(self, errors: dict[str, Any]) -> None:
        super().__init__(json.dumps(errors))
        self.errors = errors


def parse_envelope(data: dict[str, Any]) -> tuple[AuthData, dict[str, Any], Any]:
    """(auth_data, OpenAI payload, session_id) of a Vast request, as data_types.EndpointHandler.get_data_from_request
    reads it; a payload wrapped as `{"input": {...}}` (the reference OpenAI worker's request_parser) is unwrapped."""
    errors: dict[str, Any] = {}
    auth = None
    try:
        auth = AuthData.parse(data["auth_data"]) if "auth_data" in data else None
        if auth is None:
            errors["auth_data"] = "field missing"
    except EnvelopeError as exc:
        errors.update(exc.errors)
    payload = data.get("payload")
    if "payload" not in data:
        errors["payload"] = "field missing"
    elif not isinstance(payload, dict):
        errors["payload"] = {"data": "payload must be a dictionary"}
    elif isinstance(payload.get("input"), dict):
        payload = payload["input"]
    if errors:
        raise EnvelopeError(errors)
    return auth, payload, data.get("session_id")


# --- configuration -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VastConfig:
    container_id: int | str
    report_addrs: tuple[str, ...]
    mtoken: str
    url: str  # http(s)://PUBLIC_IPADDR:VAST_TCP_PORT_<port>, where Vast's router sends requests
    unsecured: bool = False
    use_ssl: bool = False
    max_queue_time: float = 30.0  # HandlerConfig default; the in-flight wait (s) above which requests get 429
    allow_plain_requests: bool = False  # bodies without auth_data (they bypass the signature)
    default_max_tokens: int = 256  # chat requests without max_tokens, in workload_of
    routes: tuple[str, ...] = VAST_ROUTES

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None,
                      **overrides: Any) -> "VastConfig | None":
        """None outside Vast (no CONTAINER_ID / REPORT_ADDR); never raises on missing platform variables.

        Reads from `environ` (default os.environ): USE_SSL (default false, as metrics.get_url) and
        VAST_TCP_PORT_<settings.port> (the public port; the listen port itself when absent). Plain requests are
        allowed when UNSECURED or an API key guards them.
        """
        if not settings.vast_mode:
            return None
        env = os.environ if environ is None else environ
        use_ssl = _truthy(env.get("USE_SSL", "false"))
        public_port = env.get(f"VAST_TCP_PORT_{settings.port}")
        if not public_port:
            log.warning("event=vast_no_public_port var=VAST_TCP_PORT_%s using=%s", settings.port, settings.port)
            public_port = str(settings.port)
        public_ip = settings.public_ipaddr
        if not public_ip:
            log.warning("event=vast_no_public_ip var=PUBLIC_IPADDR using=127.0.0.1")
            public_ip = "127.0.0.1"
        cid: int | str = settings.container_id
        try:
            cid = int(cid)
        except ValueError:
            log.warning("event=vast_container_id_not_numeric value=%s", cid)
        values: dict[str, Any] = dict(
            container_id=cid,
            report_addrs=tuple(a.strip() for a in settings.report_addr.split(",") if a.strip()),
            mtoken=settings.master_token or "",
            url=f"http{'s' if use_ssl else ''}://{public_ip}:{public_port}",
            unsecured=bool(settings.unsecured),
            use_ssl=use_ssl,
            allow_plain_requests=bool(settings.unsecured or settings.api_key),
        )
        for name in ("max_queue_time", "default_max_tokens"):
            value = getattr(settings, f"vast_{name}", None)
            if value is not None:
                values[name] = value
        values.update(overrides)
        return cls(**values)


# --- status reporting --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class RequestRecord:
    """One routed request (data_types.RequestMetrics, less the session fields)."""

    request_idx: int
    reqnum: int
    workload: float
    status: str = "Created"  # -> Started -> Success | Error | Cancelled | Rejected
    success: bool = False
    entered_queue_at: float = 0.0
    work_started_at: float = 0.0
    work_completed_at: float = 0.0
    verified: bool = False  # the router's signature was checked and held

    def delete_entry(self) -> dict[str, Any]:
        return {"request_idx": self.request_idx, "success": self.success, "status": self.status,
                "entered_queue_at": self.entered_queue_at, "work_started_at": self.work_started_at,
                "work_completed_at": self.work_completed_at}


def _disk_used_gb(path: str) -> float:
    return shutil.disk_usage(path).used / (2**30)  # psutil.disk_usage(...).used, in the framework


@dataclass
class _Counters:
    served: float = 0.0
    received: float = 0.0
    cancelled: float = 0.0
    errored: float = 0.0
    rejected: float = 0.0


class VastReporter:
    """The worker's state as the autoscaler sees it, and the two loops that tell it.

    Call from the event loop thread only. State changes are synchronous methods; `start()` runs the loops,
    `stop()` makes a last best-effort delivery and ends them.
    """

    def __init__(self, config: VastConfig, *, load_started_at: float | None = None, disk_path: str = "/",
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.disk_path = disk_path
        self.load_started_at = clock() if load_started_at is None else load_started_at
        self.loadtime: float | None = None
        self.max_perf = 0.0
        self.error_msg: str | None = None
        self.counters = _Counters()
        self.received_reqnums: set[int] = set()  # never cleared, as in the framework (num_requests_recieved)
        self.working: dict[int, RequestRecord] = {}
        self.deleting: list[RequestRecord] = []
        self.reports_sent = 0
        self._disk_reported = self._disk_now = _disk_used_gb(disk_path)
        self._seq = 0  # bumped on every change; a delivered report carries the seq it saw
        self._delivered_seq = -1
        self._urgent = False
        self._last_ok: float | None = None  # monotonic time of the last delivered report
        self._status_failures = self._delete_failures = 0
        self._status_retry_at = self._delete_retry_at = 0.0
        self._poke = asyncio.Event()
        self._deletes_ready = asyncio.Event()
        self._delivered = asyncio.Condition()
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False  # ends the loops even if a cancellation is swallowed (wait_for before 3.12)

    # state changes --------------------------------------------------------------------------------------------

    def _changed(self, urgent: bool = False) -> None:
        self._seq += 1
        self._urgent |= urgent
        self._poke.set()

    def model_loaded(self, max_perf: float) -> None:
        """Ready to serve, with the benchmark figure (units/s); reported at once."""
        self.loadtime = self.clock() - self.load_started_at
        self.max_perf = float(max_perf)
        log.info("event=vast_loaded max_perf=%.3f loadtime_s=%.2f", self.max_perf, self.loadtime)
        self._changed(urgent=True)

    def model_errored(self, message: str) -> None:
        """The worker cannot serve; reported at once (the autoscaler replaces it)."""
        self.error_msg = message
        log.error("event=vast_errored error=%s", message)
        self._changed(urgent=True)

    @property
    def loaded(self) -> bool:
        return self.loadtime is not None

    @property
    def cur_load(self) -> float:
        return float(sum(r.workload for r in self.working.values()))

    @property
    def wait_time(self) -> float:
        """Seconds the in-flight workload needs at max_perf (ModelMetrics.wait_time)."""
        return self.cur_load / max(self.max_perf, 0.00001) if self.working else 0.0

    def request_started(self, record: RequestRecord) -> None:
        record.status = "Started"
        record.work_started_at = record.work_started_at or self.clock()
        self.counters.received += record.workload
        self.received_reqnums.add(record.reqnum)
        self.working[id(record)] = record
        self._changed()

    def request_rejected(self, record: RequestRecord) -> None:
        """Refused before it started (bad signature, queue too long): rej_load, and deleted at the router."""
        record.status, record.success = "Rejected", False
        self.counters.rejected += record.workload
        self.received_reqnums.add(record.reqnum)
        self._finish(record)

    def request_finished(self, record: RequestRecord, status: str) -> None:
        """status: Success (cur_perf), Error, Cancelled (taken off new_load) or Rejected (rej_load)."""
        self.working.pop(id(record), None)
        record.status, record.success = status, status in ("Success", "Cancelled")
        if status == "Success":
            self.counters.served += record.workload
        elif status == "Cancelled":
            self.counters.cancelled += record.workload
        elif status == "Rejected":
            self.counters.rejected += record.workload
        else:
            self.counters.errored += record.workload
        self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        record.work_completed_at = self.clock()
        self.deleting.append(record)
        self._deletes_ready.set()
        self._changed()

    # messages -------------------------------------------------------------------------------------------------

    def status_payload(self) -> dict[str, Any]:
        """The `/worker_status/` body: data_types.WorkerStatusData's fields, in its order."""
        c = self.counters
        return {
            "id": self.config.container_id,
            "mtoken": self.config.mtoken,
            "version": PROTOCOL_VERSION,
            "loadtime": self.loadtime or 0.0,  # every report once loaded, as the framework sends it
            "cur_load": self.cur_load,
            "rej_load": c.rejected,
            "new_load": max(c.received - c.cancelled, 0.0),
            "error_msg": self.error_msg or "",
            "max_perf": self.max_perf,
            "cur_perf": c.served,
            "cur_capacity": 0,
            "max_capacity": 0,
            "num_requests_working": len(self.working),
            "num_requests_recieved": len(self.received_reqnums),
            "additional_disk_usage": self._disk_now - self._disk_reported,
            "disk_usage": self._disk_now,
            "working_request_idxs": [r.request_idx for r in self.working.values()],
            "url": self.config.url,
        }

    def delete_payload(self, records: list[RequestRecord]) -> dict[str, Any]:
        return {"worker_id": self.config.container_id, "mtoken": self.config.mtoken,
                "requests": [r.delete_entry() for r in records]}

    # delivery -------------------------------------------------------------------------------------------------

    async def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        return self._http

    async def _post(self, path: str, body: dict[str, Any], addrs: tuple[str, ...]) -> bool:
        """POST to the first report address that takes it (the framework's order); False if none did."""
        session = await self.http()
        for addr in addrs:
            try:
                async with session.post(addr.rstrip("/") + path, json=body) as response:
                    response.raise_for_status()
                return True
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("event=vast_report_failed path=%s addr=%s error=%r", path, addr, exc)
        return False

    async def send_status(self) -> bool:
        """One report now. On delivery the counters lose what it carried (changes made meanwhile stay)."""
        self._disk_now = _disk_used_gb(self.disk_path)
        body, seq, sent = self.status_payload(), self._seq, asdict(self.counters)
        urgent, self._urgent = self._urgent, False
        if not await self._post("/worker_status/", body, self.config.report_addrs):
            self._urgent |= urgent
            return False
        for name, value in sent.items():
            left = getattr(self.counters, name) - value
            setattr(self.counters, name, left if left > 1e-9 else 0.0)
        self._disk_reported = body["disk_usage"]
        self._delivered_seq = max(self._delivered_seq, seq)
        self._last_ok = time.monotonic()
        self.reports_sent += 1
        async with self._delivered:
            self._delivered.notify_all()
        return True

    async def send_deletes(self) -> bool:
        records = list(self.deleting)
        if not records:
            return True
        addrs = tuple(a for a in self.config.report_addrs if a != REDIS_REPORT_ADDR)
        if not addrs or not await self._post("/delete_requests/", self.delete_payload(records), addrs):
            return not addrs
        sent = {id(r) for r in records}
        self.deleting[:] = [r for r in self.deleting if id(r) not in sent]
        return True

    async def flush(self, timeout: float = HTTP_TIMEOUT_S) -> bool:
        """Wait until a report carrying every change made so far was delivered; False on timeout."""
        target = self._seq
        self._poke.set()

        async def delivered() -> None:
            async with self._delivered:
                await self._delivered.wait_for(lambda: self._delivered_seq >= target)

        try:
            await asyncio.wait_for(delivered(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _status_delay(self, now: float) -> float:
        if self._status_retry_at > now:
            return self._status_retry_at - now
        if self._urgent or self._last_ok is None:
            return 0.0
        pending = self._seq != self._delivered_seq
        return self._last_ok + (STATUS_BUSY_INTERVAL_S if pending else STATUS_IDLE_INTERVAL_S) - now

    async def _status_loop(self) -> None:
        while not self._stopping:
            self._poke.clear()
            delay = self._status_delay(time.monotonic())
            if delay > 0:
                try:
                    await asyncio.wait_for(self._poke.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                ok = await self.send_status()
            except Exception:  # never let reporting take the server down
                log.exception("event=vast_status_error")
                ok = False
            self._status_failures = 0 if ok else self._status_failures + 1
            self._status_retry_at = 0.0 if ok else time.monotonic() + _backoff(self._status_failures)

    async def _delete_loop(self) -> None:
        while not self._stopping:
            self._deletes_ready.clear()
            if not self.deleting:
                await self._deletes_ready.wait()
                continue
            wait = self._delete_retry_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                ok = await self.send_deletes()
            except Exception:
                log.exception("event=vast_delete_error")
                ok = False
            self._delete_failures = 0 if ok else self._delete_failures + 1
            self._delete_retry_at = 0.0 if ok else time.monotonic() + _backoff(self._delete_failures)

    def start(self) -> None:
        if not self._tasks:
            self._stopping = False
            self._tasks = [asyncio.create_task(self._status_loop(), name="vast-status"),
                           asyncio.create_task(self._delete_loop(), name="vast-delete-requests")]

    async def stop(self, timeout: float = 2.0) -> None:
        """End the loops after a last best-effort delivery of finished requests and counters."""
        self._stopping = True
        self._poke.set()
        self._deletes_ready.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            await asyncio.wait_for(asyncio.gather(self.send_deletes(), self.send_status()), timeout)
        except (asyncio.TimeoutError, Exception) as exc:
            log.warning("event=vast_final_report_failed error=%r", exc)
        if self._http is not None:
            await self._http.close()
            self._http = None


def _backoff(failures: int) -> float:
    return RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1]


# --- the worker: key, admission, middleware ----------------------------------------------------------------------


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


# --- TLS (USE_SSL=true) ------------------------------------------------------------------------------------------


def server_ssl_context(cert: Path = INSTANCE_CERT, key: Path = INSTANCE_KEY) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


def _cert_matches(cert_pem: bytes, key: rsa.RSAPrivateKey) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


def instance_csr(key: rsa.RSAPrivateKey) -> bytes:
    """start_server.sh's request: CN=pyworker.vast.ai, C=US, ST=CA, SAN IP 0.0.0.0, not a CA, PEM."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
                         x509.NameAttribute(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "pyworker.vast.ai")])
    usage = x509.KeyUsage(digital_signature=True, content_commitment=True, key_encipherment=True,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False)
    csr = (x509.CertificateSigningRequestBuilder().subject_name(subject)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=False)
           .add_extension(usage, critical=False)
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("0.0.0.0"))]),
                          critical=False)
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


async def ensure_instance_cert(container_id: int | str, *, cert: Path = INSTANCE_CERT, key: Path = INSTANCE_KEY,
                               sign_url: str = SIGN_CERT_URL, attempts: int = 5, backoff_s: float = 2.0) -> bool:
    """Make sure the instance certificate exists (what start_server.sh does when USE_SSL=true, and the base image
    may already have done): a fresh key, its CSR signed by Vast's console, installed only once it parses and
    matches the key. False when it could not be had (serve plain HTTP then, with USE_SSL=false)."""
    if cert.exists() and key.exists():
        try:
            private = serialization.load_pem_private_key(key.read_bytes(), password=None)
            if isinstance(private, rsa.RSAPrivateKey) and _cert_matches(cert.read_bytes(), private):
                return True
        except ValueError:
            pass
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = instance_csr(private)
    url = f"{sign_url}?instance_id={container_id}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for attempt in range(1, attempts + 1):
            try:
                async with session.post(url, data=csr, headers={"Content-Type": "application/octet-stream"}) as r:
                    r.raise_for_status()
                    signed = await r.read()
                if _cert_matches(signed, private):
                    break
                log.warning("event=vast_cert_unusable attempt=%d", attempt)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("event=vast_cert_sign_failed attempt=%d error=%r", attempt, exc)
            if attempt < attempts:
                await asyncio.sleep(backoff_s)
        else:
            return False
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption())
    _write_atomic(key, key_pem, 0o600)
    _write_atomic(cert, signed, 0o644)
    return True


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


# --- startup benchmark -------------------------------------------------------------------------------------------

BENCHMARK_VERSION = 1  # bump when the payload or the workload definition changes (invalidates every cache)
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
    best, total, index = 0.0, 0.0, 0
    for run in range(1, runs + 1):
        payloads = [payload_fn(index + i) for i in range(concurrency)]
        index += concurrency
        start = time.perf_counter()
        results = await asyncio.gather(*(generate_fn(p) for p in payloads), return_exceptions=True)
        elapsed = time.perf_counter() - start
        failed = [r for r in results if isinstance(r, BaseException)]
        done = sum(workload_of(p) for p, r in zip(payloads, results) if not isinstance(r, BaseException))
        if not done:
            raise BenchmarkFailed(f"no successful benchmark request in round {run}: {failed[0]!r}")
        perf = done / elapsed
        total += perf
        best = max(best, perf)
        log.info("event=vast_benchmark_round run=%d concurrency=%d workload=%.0f elapsed_s=%.3f perf=%.2f failed=%d",
                 run, concurrency, done, elapsed, perf, len(failed))
    log.info("event=vast_benchmark max_perf=%.2f mean_perf=%.2f", best, total / runs)
    return best


def benchmark_key(*, model: str, revision: str | None, engine_version: str, **extra: Any) -> dict[str, Any]:
    """What a cached max_perf depends on. Pass in `extra` whatever else changes throughput (GPU name and count,
    max_num_seqs, dtype, max_num_batched_tokens, the benchmark's runs / concurrency)."""
    return {"benchmark_version": BENCHMARK_VERSION, "model": model, "revision": revision,
            "engine_version": engine_version, **{k: extra[k] for k in sorted(extra)}}


def _key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


async def cached_max_perf(path: Path, key: Mapping[str, Any], measure: Callable[[], Awaitable[float]]
                          ) -> tuple[float, bool]:
    """(max_perf, came from the cache). The cache file (JSON, under /workspace so it outlives a stop) is used only
    when its key matches exactly; otherwise `measure()` runs and replaces it. A cache that cannot be read or
    written is logged and ignored."""
    digest = _key_digest(key)
    try:
        cached = json.loads(path.read_text())
        if cached.get("digest") == digest and float(cached["max_perf"]) > 0:
            log.info("event=vast_benchmark_cached max_perf=%.2f path=%s", float(cached["max_perf"]), path)
            return float(cached["max_perf"]), True
        log.info("event=vast_benchmark_stale path=%s", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("event=vast_benchmark_cache_unreadable path=%s error=%r", path, exc)
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
