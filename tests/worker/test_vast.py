"""worker.vast against the `vastai` package itself and a local stand-in for Vast's autoscaler.

The stand-in controller (`vast_helpers.Controller`) records what the worker reports and routes with signed replies.
Requests go through the package's real client (`CoroutineServerless` / `Endpoint.request`, pointed at the stand-in
with `autoscaler_url`), and the framework's own `Metrics` and `Backend.__check_signature` are run side by side with ours to prove equal shapes and verdicts.

The OpenAI handler here is a trivial /v1/completions that reads the hook (`openai_body`); the signature, admission
and reporting code under test is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import json
import ssl
import time
from typing import Any, Callable

import aiohttp
import pytest
from aiohttp import web
from Crypto.PublicKey import RSA
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from vastai.serverless.server.lib import backend as vbackend
from vastai.serverless.server.lib import metrics as vmetrics
from vastai.serverless.server.lib.data_types import AuthData as VAuthData
from vastai.serverless.server.lib.data_types import RequestMetrics, WorkerStatusData

import worker.vast as vast
from worker.settings import Settings
from vast_helpers import CONTAINER_ID, MTOKEN, Controller, free_port, pem_public, sign_url, vast_client
from worker.vast import (
    PUBKEY_FAILED, VAST_APP_KEY, RequestRecord, VastConfig, VastReporter, VastWorker, benchmark_key,
    benchmark_payload, cached_max_perf, ensure_instance_cert, load_public_key, measure_max_perf, openai_body,
    vast_middleware, vast_verified, verify_signature, workload_of,
)

def make_settings(report_addr: str, port: int, **overrides: Any) -> Settings:
    fields: dict[str, Any] = dict(container_id=str(CONTAINER_ID), report_addr=report_addr, master_token=MTOKEN,
                                  public_ipaddr="127.0.0.1", port=port, unsecured=False, api_key=None)
    fields.update(overrides)
    return Settings(**fields)


class WorkerApp:
    """Our middleware in front of a trivial /v1/completions that reads the hook; `hold` parks requests."""

    def __init__(self, worker: VastWorker | None) -> None:
        self.worker = worker
        self.seen: list[Any] = []
        self.hold = False
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.cancelled = 0

    async def completions(self, request: web.Request) -> web.Response:
        body = await openai_body(request)
        self.seen.append({"body": body, "verified": vast_verified(request),
                          "auth": request.headers.get("Authorization")})
        self.entered.set()
        try:
            if self.hold:
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return web.json_response({
            "id": "cmpl-test", "object": "text_completion", "created": 0, "model": body.get("model", "tiny"),
            "choices": [{"index": 0, "text": f"echo: {body['prompt']}", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    async def start(self, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        app = web.Application(middlewares=[vast_middleware])
        if self.worker is not None:
            app[VAST_APP_KEY] = self.worker
        app.router.add_post("/v1/completions", self.completions)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=ssl_context).start()

    async def stop(self) -> None:
        await self._runner.cleanup()


@contextlib.asynccontextmanager
async def deployment(router_key, *, load: float | None = 50.0, environ: dict[str, str] | None = None,
                     ssl_context: Callable[[VastWorker], ssl.SSLContext | None] = lambda w: None,
                     worker_kwargs: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                     **settings_overrides: Any):
    """A controller, a VastWorker from Settings (as the server will build it) and the worker app, all started;
    `load` (when not None) marks the worker loaded with that max_perf."""
    async with Controller(router_key) as ctl:
        port = free_port()
        env = {f"VAST_TCP_PORT_{port}": str(port), **(environ or {})}
        settings = make_settings(ctl.url, port, **settings_overrides)
        if config:
            worker = VastWorker(VastConfig.from_settings(settings, env, **config), **(worker_kwargs or {}))
        else:  # as the server builds it
            worker = VastWorker.from_settings(settings, env, **(worker_kwargs or {}))
        app = WorkerApp(worker)
        await app.start(port, ssl_context(worker))
        await worker.start()
        try:
            if load is not None:
                assert await worker.mark_loaded(load)
                await ctl.wait_status(lambda s: s["loadtime"] > 0)
            yield ctl, worker, app
        finally:
            await worker.stop()
            await app.stop()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def quick_busy_reports(monkeypatch):
    """Busy reports every 0.1 s instead of 1 s, so the tests need not wait (test_report_cadence checks the logic)."""
    monkeypatch.setattr(vast.reporter, "STATUS_BUSY_INTERVAL_S", 0.1)


@pytest.fixture()
def fast_backoff(monkeypatch):
    monkeypatch.setattr(vast.reporter, "RETRY_BACKOFF_S", (0.02, 0.05, 0.1))


# --- workload units --------------------------------------------------------------------------------------------------


def test_workload_is_prompt_tokens_plus_max_tokens():
    assert workload_of({"prompt": "x" * 10, "max_tokens": 100}) == 3 + 100  # ceil(10 / 4)
    assert workload_of({"prompt": [1, 2, 3, 4, 5], "max_tokens": 7}) == 12  # token ids count exactly
    assert workload_of({"prompt": ["abcd", [1, 2]], "max_tokens": 10, "n": 2}) == 2 * ((1 + 10) + (2 + 10))
    assert workload_of({"prompt": "abcdefgh"}) == 2 + 16  # /v1/completions default max_tokens
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_completion_tokens": 50, "max_tokens": 9}
    assert workload_of(chat) == 3 + 50  # "user" + "hi there" = 12 chars; max_completion_tokens wins
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 40}]}]}
    assert workload_of(parts, default_max_tokens=300) == 12 + 300  # chat without max_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}
    parts["messages"][0]["content"].append(image)
    assert workload_of(parts, default_max_tokens=300) == 12 + 300  # an image's URL is not priced as text
    assert workload_of({"prompt": "x" * 40, "max_tokens": 5}, count_tokens=lambda s: 3) == 8
    assert workload_of({"foo": 1}) == workload_of("nonsense") == 100.0  # the framework's fallback
    body = benchmark_payload(0)
    assert workload_of(body) == 384 + 256 and body["ignore_eos"] and body != benchmark_payload(1)


# --- signatures: ours and the framework's agree -----------------------------------------------------------------------


def framework_backend(monkeypatch, report_addr: str, pubkey_pem: str | None, unsecured: bool = False):
    """The framework's own Backend (backend.py), whose private __check_signature is the reference."""
    for name, value in dict(CONTAINER_ID=str(CONTAINER_ID), REPORT_ADDR=report_addr, WORKER_PORT="3000",
                            VAST_TCP_PORT_3000="41234", PUBLIC_IPADDR="127.0.0.1", MASTER_TOKEN=MTOKEN,
                            UNSECURED=str(unsecured).lower()).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("USE_SSL", raising=False)
    vmetrics.get_url.cache_clear()
    backend = vbackend.Backend(model_server_url="http://127.0.0.1:1", model_log_file="/nonexistent",
                               benchmark_handler=None, log_actions=[])
    backend._pubkey = RSA.import_key(pubkey_pem) if pubkey_pem else None
    return backend


def test_signature_verdicts_match_the_framework(monkeypatch, router_key):
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    backend = framework_backend(monkeypatch, "http://127.0.0.1:9", pem_public(router_key))
    ours = load_public_key(pem_public(router_key))
    url = "https://1.2.3.4:41234"
    good = sign_url(router_key, url)
    cases = {
        "good": (url, good, True),
        "other url": ("https://6.6.6.6:41234", good, False),
        # Signed for another worker: valid, the framework never ties the url to itself (neither do we).
        "another worker": ("https://6.6.6.6:1", sign_url(router_key, "https://6.6.6.6:1"), True),
        "other key": (url, sign_url(other, url), False),
        "truncated": (url, good[:-8], False),
        "not base64": (url, "!!!not-base64!!!", False),
        "empty": (url, "", False),
    }
    for name, (u, sig, expected) in cases.items():
        auth = VAuthData(cost="100", endpoint="ep", reqnum=1, request_idx=1, signature=sig, url=u)
        assert backend._Backend__check_signature(auth) is expected, name
        assert verify_signature(ours, u, sig) is expected, name
    # The router's key may come as PKCS#1 PEM too; both parsers take it.
    pkcs1 = pem_public(router_key, serialization.PublicFormat.PKCS1)
    assert verify_signature(load_public_key(pkcs1), url, good) and RSA.import_key(pkcs1)
    asyncio.run(backend.metrics.aclose())


# --- status messages: same shape and values as the framework's Metrics ------------------------------------------------


def test_status_and_delete_messages_match_the_framework(monkeypatch, router_key):
    async def main():
        async with Controller(router_key) as ctl:
            backend = framework_backend(monkeypatch, ctl.url, None)
            fm = backend.metrics  # version and mtoken set as the framework sets them
            config = VastConfig.from_settings(make_settings(ctl.url, 3000), {"VAST_TCP_PORT_3000": "41234"})
            ours = VastReporter(config)
            assert config.url == fm.url == "http://127.0.0.1:41234"

            fm._model_loaded(max_throughput=123.5)
            ours.model_loaded(123.5)
            fa, fb, fc = (RequestMetrics(request_idx=i, reqnum=r, workload=w, status="Created")
                          for i, r, w in ((7, 1, 100.0), (8, 2, 50.0), (9, 3, 30.0)))
            oa, ob, oc = (RequestRecord(request_idx=i, reqnum=r, workload=w)
                          for i, r, w in ((7, 1, 100.0), (8, 2, 50.0), (9, 3, 30.0)))
            fm._request_start(fa), fm._request_start(fb), fm._request_success(fa), fm._request_end(fa)
            fm._request_reject(fc)
            ours.request_started(oa), ours.request_started(ob), ours.request_finished(oa, "Success")
            ours.request_rejected(oc)

            rounds = []
            for _ in range(2):
                await fm._Metrics__send_metrics_and_reset()
                await fm._Metrics__send_delete_requests_and_reset()
                assert await ours.send_status() and await ours.send_deletes()
                rounds.append((ctl.statuses[-2], ctl.statuses[-1], ctl.deletes[-2], ctl.deletes[-1]))
                fm._request_canceled(fb), fm._request_end(fb)  # the client of request 8 leaves
                ours.request_finished(ob, "Cancelled")
            await fm.aclose()
            await ours.stop()

            names = [f.name for f in dataclasses.fields(WorkerStatusData)]
            for theirs, mine, their_del, my_del in rounds:
                assert list(theirs) == list(mine) == names
                for name in names:
                    a, b = theirs[name], mine[name]
                    if isinstance(a, (int, float)) and not isinstance(a, bool):
                        assert isinstance(b, (int, float)) and not isinstance(b, bool), name
                    else:
                        assert type(a) is type(b), name
                    if name in ("disk_usage", "additional_disk_usage"):
                        assert b == pytest.approx(a, abs=0.5), name
                    elif name == "loadtime":
                        assert a > 0 and b > 0
                    else:
                        assert a == b, name
                assert list(their_del) == list(my_del) == ["worker_id", "mtoken", "requests"]
                assert their_del["worker_id"] == my_del["worker_id"] == CONTAINER_ID
                for t, m in zip(their_del["requests"], my_del["requests"], strict=True):
                    assert list(t) == list(m)
                    assert {k: t[k] for k in ("request_idx", "success", "status")} == \
                           {k: m[k] for k in ("request_idx", "success", "status")}
                    assert all(isinstance(m[k], float) for k in ("entered_queue_at", "work_started_at",
                                                                 "work_completed_at"))
            first, second = rounds
            assert (first[1]["cur_load"], first[1]["new_load"], first[1]["rej_load"], first[1]["cur_perf"]) == \
                   (50.0, 150.0, 30.0, 100.0)
            assert first[1]["working_request_idxs"] == [8] and first[1]["num_requests_recieved"] == 3
            assert [r["status"] for r in first[3]["requests"]] == ["Success", "Rejected"]
            # Counters reset after a delivered report: only the cancellation is new (new_load clamps at 0).
            assert (second[1]["cur_load"], second[1]["new_load"], second[1]["rej_load"], second[1]["cur_perf"]) == \
                   (0.0, 0.0, 0.0, 0.0)
            assert second[3]["requests"] == [dict(second[3]["requests"][0], request_idx=8, status="Cancelled",
                                                  success=True)]

    run(main())


def test_loaded_is_reported_at_once_with_the_benchmark_figure(router_key):
    async def fake_engine(body: dict) -> None:
        await asyncio.sleep(0.02)

    async def main():
        async with deployment(router_key, load=None) as (ctl, worker, app):
            first = await ctl.wait_status(lambda s: True)
            assert (first["loadtime"], first["max_perf"], first["error_msg"]) == (0.0, 0.0, "")  # loading
            assert first["id"] == CONTAINER_ID and first["mtoken"] == MTOKEN and first["version"] == "1.1.0"
            assert first["url"] == worker.config.url and first["url"].startswith("http://127.0.0.1:")
            await asyncio.sleep(0.1)  # let the first report's 10 s idle timer start
            perf = await measure_max_perf(fake_engine, runs=2, concurrency=4)
            assert 4 * 640 / 0.02 * 0.5 < perf <= 4 * 640 / 0.02  # units/s of 640-unit requests
            start = time.monotonic()
            assert await worker.mark_loaded(perf)
            loaded = await ctl.wait_status(lambda s: s["loadtime"] > 0)
            lag = ctl.status_times[ctl.statuses.index(loaded)] - start
            assert lag < 0.5, f"loaded reached the controller after {lag:.2f}s"
            assert loaded["max_perf"] == perf and loaded["loadtime"] > 0.1

    run(main())


def test_report_cadence_busy_then_idle(monkeypatch, router_key):
    monkeypatch.setattr(vast.reporter, "STATUS_BUSY_INTERVAL_S", 0.1)
    monkeypatch.setattr(vast.reporter, "STATUS_IDLE_INTERVAL_S", 0.4)

    async def main():
        async with deployment(router_key) as (ctl, worker, app):
            await asyncio.sleep(0.05)
            n = len(ctl.statuses)
            record = RequestRecord(request_idx=1, reqnum=1, workload=10.0)
            worker.reporter.request_started(record)
            await ctl.wait_status(lambda s: s["cur_load"] == 10.0, timeout=0.3)  # within one busy interval
            worker.reporter.request_finished(record, "Success")
            await ctl.wait_status(lambda s: s["cur_perf"] == 10.0, timeout=0.3)
            quiet = len(ctl.statuses)
            await asyncio.sleep(0.3)
            assert len(ctl.statuses) == quiet  # nothing changed: no report before the idle interval
            await asyncio.sleep(0.3)
            assert len(ctl.statuses) == quiet + 1 and ctl.statuses[-1]["cur_perf"] == 0.0  # idle heartbeat
            assert n >= 1

    run(main())


# --- requests through the vastai client ---------------------------------------------------------------------------


def test_signed_request_through_the_vastai_client(router_key):
    async def main():
        async with deployment(router_key) as (ctl, worker, app):
            client, endpoint = vast_client(ctl)
            payload = {"model": "tiny", "prompt": "x" * 40, "max_tokens": 20}
            result = await endpoint.request("/v1/completions", payload, cost=30)
            await client.close()
            assert result["ok"] and result["status"] == 200, result
            assert result["response"]["choices"][0]["text"] == "echo: " + "x" * 40
            assert result["url"] == worker.config.url
            assert app.seen == [{"body": payload, "verified": True, "auth": "Bearer endpoint-key"}]
            idx = ctl.routes[0]["request_idx"]
            entry = await ctl.wait_delete(idx)
            assert entry["status"] == "Success" and entry["success"] is True
            assert entry["entered_queue_at"] <= entry["work_started_at"] <= entry["work_completed_at"]
            served = await ctl.wait_status(lambda s: s["cur_perf"] > 0)
            assert sum(s["cur_perf"] for s in ctl.statuses) == 10 + 20  # ceil(40 / 4) + max_tokens
            assert sum(s["new_load"] for s in ctl.statuses) == 10 + 20
            assert served["num_requests_recieved"] == 1 and served["cur_load"] == 0.0
            assert served["working_request_idxs"] == []
            # reset once that report was delivered: the reporter hears the controller's answer after the controller
            # has recorded the report, so the reset can come a moment after the status above was seen
            deadline = time.monotonic() + 5
            while worker.reporter.counters.served != 0.0 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert worker.reporter.counters.served == 0.0

    run(main())


def test_bad_signature_is_refused(router_key):
    async def main():
        async with deployment(router_key) as (ctl, worker, app):
            url = worker.config.url + "/v1/completions"
            # auth_data as client.py _do_request forwards the route reply: our url, the signature of another url.
            auth = {"url": worker.config.url, "reqnum": 5, "signature": sign_url(router_key, "https://6.6.6.6:1"),
                    "endpoint": "glm-endpoint", "cost": 30, "request_idx": 55, "__request_id": "x"}
            async with aiohttp.ClientSession() as http:
                body = {"auth_data": auth, "session_id": None, "payload": {"prompt": "hi", "max_tokens": 4}}
                async with http.post(url, json=body) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_signature"
                other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
                forged = dict(auth, signature=sign_url(other_key, worker.config.url))  # signed by someone else
                async with http.post(url, json=dict(body, auth_data=forged)) as r:
                    assert r.status == 401
                missing = {k: v for k, v in auth.items() if k not in ("signature", "cost")}
                async with http.post(url, json=dict(body, auth_data=missing)) as r:
                    assert r.status == 422
                    assert await r.json() == {"auth_data": {"cost": "missing parameter",
                                                            "signature": "missing parameter"}}
                async with http.post(url, json=dict(body, payload="text")) as r:
                    assert r.status == 422
                    assert await r.json() == {"payload": {"data": "payload must be a dictionary"}}
                good = dict(auth, url=worker.config.url, signature=sign_url(router_key, worker.config.url))
                async with http.post(url, json=dict(body, auth_data=good, session_id="s1")) as r:
                    assert r.status == 410  # no sessions on this worker
            assert app.seen == []
            assert (await ctl.wait_delete(55))["status"] == "Rejected"
            await ctl.wait_status(lambda s: s["rej_load"] > 0)
            await worker.reporter.flush(2)
            assert sum(s["rej_load"] for s in ctl.statuses) == 2 * (1 + 4)  # the two 401s; not 422 / 410

    run(main())


def test_unsecured_skips_verification(router_key):
    async def main():
        async with deployment(router_key, unsecured=True) as (ctl, worker, app):
            auth = {"url": "anything", "reqnum": 1, "signature": "garbage", "endpoint": "e", "cost": 1,
                    "request_idx": 3}
            async with aiohttp.ClientSession() as http:
                body = {"auth_data": auth, "payload": {"prompt": "hi", "max_tokens": 4}}
                async with http.post(worker.config.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            assert ctl.pubkey_gets == 0 and worker.pubkey is None
            assert app.seen[0]["verified"] is False  # UNSECURED never counts as verified (bearer still applies)

    run(main())


def test_queue_time_over_the_limit_gets_429(router_key):
    async def main():
        # max_perf 10 units/s and 2 s allowed: one 30-unit request in flight means 3 s of queue.
        async with deployment(router_key, load=10.0, config={"max_queue_time": 2.0}) as (ctl, worker, app):
            assert worker.config.max_queue_time == 2.0
            app.hold = True
            client, endpoint = vast_client(ctl)
            first = asyncio.create_task(endpoint.request("/v1/completions", {"prompt": "x" * 40, "max_tokens": 20},
                                                         cost=30))
            await asyncio.wait_for(app.entered.wait(), 5)
            assert worker.reporter.wait_time == 3.0
            second = await endpoint.request("/v1/completions", {"prompt": "y", "max_tokens": 4}, cost=5, retry=False)
            assert second["status"] == 429 and not second["ok"]
            rejected = await ctl.wait_status(lambda s: s["rej_load"] > 0)
            assert rejected["rej_load"] == 5 and rejected["cur_load"] == 30
            app.release.set()
            assert (await first)["status"] == 200
            await client.close()
            assert len(app.seen) == 1

    run(main())


def test_client_disconnect_counts_as_cancelled(router_key):
    async def main():
        async with deployment(router_key) as (ctl, worker, app):
            app.hold = True
            auth = {"url": worker.config.url, "reqnum": 9, "signature": sign_url(router_key, worker.config.url),
                    "endpoint": "e", "cost": 12, "request_idx": 99}
            body = {"auth_data": auth, "session_id": None, "payload": {"prompt": "x" * 8, "max_tokens": 10}}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as http:
                with pytest.raises((asyncio.TimeoutError, aiohttp.ClientError)):
                    await http.post(worker.config.url + "/v1/completions", json=body)
            entry = await ctl.wait_delete(99)
            assert entry["status"] == "Cancelled" and entry["success"] is True
            assert app.cancelled == 1 and worker.reporter.working == {}

    run(main())


def test_plain_requests_pass_through_only_when_allowed(router_key):
    async def main():
        plain = {"prompt": "hi", "max_tokens": 4}
        async with deployment(router_key) as (ctl, worker, app):
            async with aiohttp.ClientSession() as http:
                async with http.post(worker.config.url + "/v1/completions", json=plain) as r:
                    assert r.status == 401  # would bypass the router's signature
        async with deployment(router_key, api_key="sk-test") as (ctl, worker, app):
            async with aiohttp.ClientSession() as http:
                async with http.post(worker.config.url + "/v1/completions", json=plain) as r:
                    assert r.status == 200
            assert app.seen[0]["body"] == plain and app.seen[0]["verified"] is False
        # Outside Vast the middleware is inert and the body is read as usual.
        app = WorkerApp(None)
        port = free_port()
        await app.start(port)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=plain) as r:
                assert r.status == 200
        await app.stop()
        assert app.seen[0]["body"] == plain
        assert VastConfig.from_settings(Settings(port=3000, container_id=None, report_addr=None)) is None

    run(main())


# --- failures: the reporter retries, the key fetch retries --------------------------------------------------------


def test_reporting_survives_controller_errors(router_key, fast_backoff):
    async def main():
        async with deployment(router_key, load=None) as (ctl, worker, app):
            ctl.fail_status = 3
            await asyncio.sleep(0.05)
            worker.reporter.request_started(record := RequestRecord(request_idx=1, reqnum=1, workload=7.0))
            worker.reporter.request_finished(record, "Success")
            assert await worker.mark_loaded(5.0)
            status = await ctl.wait_status(lambda s: s["loadtime"] > 0)
            assert status["max_perf"] == 5.0 and ctl.fail_status == 0
            assert sum(s["cur_perf"] for s in ctl.statuses) == 7.0  # nothing lost to the failures

    run(main())


def test_pubkey_fetch_retries_then_errors_the_worker(router_key):
    async def main():
        async with Controller(router_key) as ctl:
            ctl.fail_pubkey = 2
            worker = VastWorker(VastConfig.from_settings(make_settings(ctl.url, 3000), {}), pubkey_backoff_s=0.01)
            await worker.start()
            assert await worker.mark_loaded(1.0) and worker.pubkey is not None and ctl.pubkey_gets == 3
            await worker.stop()

            ctl.fail_pubkey, ctl.pubkey_gets = 99, 0
            worker = VastWorker(VastConfig.from_settings(make_settings(ctl.url, 3000), {}), pubkey_attempts=3,
                                pubkey_backoff_s=0.01)
            await worker.start()
            assert not await worker.mark_loaded(1.0)
            errored = await ctl.wait_status(lambda s: s["error_msg"] == PUBKEY_FAILED)
            assert errored["loadtime"] == 0.0 and ctl.pubkey_gets == 3
            await worker.stop()

            # By default it keeps trying while the model loads; loading with no key yet waits, then errors.
            ctl.statuses.clear()
            worker = VastWorker(VastConfig.from_settings(make_settings(ctl.url, 3000), {}), pubkey_backoff_s=0.01)
            await worker.start()
            assert not await worker.mark_loaded(1.0, pubkey_wait_s=0.3)
            assert (await ctl.wait_status(lambda s: s["error_msg"] == PUBKEY_FAILED))["loadtime"] == 0.0
            assert ctl.pubkey_gets > 3 and not worker._pubkey_task.done()  # still trying
            await worker.stop()

    run(main())


def test_report_fatal_reaches_the_controller_before_exit(router_key):
    async def main():
        async with Controller(router_key) as ctl:
            worker = VastWorker(VastConfig.from_settings(make_settings(ctl.url, 3000), {}))
            assert await worker.report_fatal("engine: CUDA out of memory", timeout=5)
            assert ctl.statuses[-1]["error_msg"] == "engine: CUDA out of memory"
            await worker.stop()

    run(main())


# --- the startup benchmark ------------------------------------------------------------------------------------------


def test_benchmark_cache_skips_a_rerun_until_the_version_changes(tmp_path):
    calls = []

    async def engine(body: dict) -> None:
        calls.append(body)
        await asyncio.sleep(0.01)

    async def main():
        path = tmp_path / "vast_benchmark.json"
        key = benchmark_key(model="glm-5.3-flash", revision="abc123", engine_version="0.1.0", gpu="H200",
                            max_num_seqs=4)
        measure = lambda: measure_max_perf(engine, 2, 4)  # noqa: E731
        perf, cached = await cached_max_perf(path, key, measure)
        assert not cached and perf > 0 and len(calls) == 8
        assert all(b["max_tokens"] == 256 and workload_of(b) == 640 for b in calls)
        again, cached = await cached_max_perf(path, dict(key), measure)
        assert cached and again == perf and len(calls) == 8  # same snapshot: no rerun
        bumped = dict(key, engine_version="0.2.0")
        _, cached = await cached_max_perf(path, bumped, measure)
        assert not cached and len(calls) == 16
        assert json.loads(path.read_text())["key"]["engine_version"] == "0.2.0"

        async def broken(body: dict) -> None:
            raise RuntimeError("engine down")

        with pytest.raises(vast.BenchmarkFailed):
            await measure_max_perf(broken, 1, 2)

    run(main())


# --- TLS (USE_SSL=true): the instance certificate and an https request ---------------------------------------------


def test_instance_cert_and_https_request(tmp_path, router_key):
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test vast root")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    requests = []

    def signer(csr_pem: bytes, instance_id: str) -> bytes:
        csr = x509.load_pem_x509_csr(csr_pem)
        requests.append((csr, instance_id))
        assert csr.is_signature_valid
        cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca_name).public_key(csr.public_key())
                .serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False).sign(ca_key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM)

    cert, key = tmp_path / "instance.crt", tmp_path / "instance.key"

    async def main():
        async with Controller(router_key) as ctl:
            ctl.cert_signer = signer
            sign = ctl.url + "/api/v0/sign_cert/"
            assert await ensure_instance_cert(CONTAINER_ID, cert=cert, key=key, sign_url=sign)
            assert await ensure_instance_cert(CONTAINER_ID, cert=cert, key=key, sign_url=sign)  # kept: no new CSR
        assert len(requests) == 1 and requests[0][1] == str(CONTAINER_ID)
        csr = requests[0][0]
        assert csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "pyworker.vast.ai"
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("0.0.0.0")]
        assert key.stat().st_mode & 0o777 == 0o600

        async with deployment(router_key, environ={"USE_SSL": "true"},
                              ssl_context=lambda w: w.ssl_context(cert, key)) as (ctl, worker, app):
            assert worker.config.url.startswith("https://127.0.0.1:")
            client, endpoint = vast_client(ctl, ssl.create_default_context(cafile=str(tmp_path / "ca.pem")))
            result = await endpoint.request("/v1/completions", {"prompt": "tls", "max_tokens": 3}, cost=4)
            await client.close()
            assert result["status"] == 200 and result["url"].startswith("https://")

    run(main())


BENCHMARK_S = 4.0  # the end-to-end servers' startup benchmark bound


def test_bounded_benchmark_fits_its_budget_on_a_slow_engine():
    """An engine at 400 units/s, where the realistic payload's 3 rounds of 8 would take 31 s: a probe round
    sizes the rounds, the whole benchmark stays within its 1.5 s, and the figure is the engine's rate."""
    rate = 400.0

    async def slow_engine(body: dict) -> None:
        await asyncio.sleep(workload_of(body) * 8 / rate)  # 8 concurrent requests share the rate

    async def main():
        start = time.perf_counter()
        perf = await vast.measure_max_perf_within(slow_engine, 1.5, runs=3, concurrency=8)
        elapsed = time.perf_counter() - start
        assert elapsed < 1.5 * 1.2, elapsed
        assert 0.7 * rate < perf <= rate * 1.05

    run(main())


def test_benchmark_runs_through_the_real_engine(tmp_path):
    """measure_max_perf over engine_generate_fn with the embedded tiny model on the CPU: every benchmark request
    generates its full max_tokens (ignore_eos), and the figure is in workload units/s."""
    from provision.stages import StageClock
    from worker.provisioning import provision_and_load
    from worker.served_model import build_served_model

    settings = Settings(model=None, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=1024,
                        cache_dir=tmp_path, container_id=None, report_addr=None)
    model = build_served_model(provision_and_load(settings, StageClock(300.0)), settings)
    payload = lambda i: benchmark_payload(i, prompt_units=16, max_tokens=8)  # noqa: E731

    async def main():
        model.engine.start()
        try:
            generate = vast.engine_generate_fn(model)
            assert await generate(payload(0)) == 8
            start = time.perf_counter()
            perf = await measure_max_perf(generate, 1, 2, payload_fn=payload)
            assert 0 < perf and perf >= 2 * workload_of(payload(0)) / (time.perf_counter() - start)
        finally:
            await model.engine.shutdown()

    run(main())


# --- end to end: the real server (`serve()`, tiny model, CPU) under the stand-in controller ------------------------


def _stage_s(ready_body: dict[str, Any], name: str, until: str = "ready") -> float:
    """Seconds a server spent from stage `name` to stage `until`, from /ready's stage history."""
    at = {s["stage"]: s["at_s"] for s in ready_body["stages"]}
    return at[until] - at[name]


def test_real_server_end_to_end_under_the_stand_in_controller(router_key, tiny_model_dir, tmp_path, monkeypatch):
    """The whole Vast flow through `serve()` with the tiny model on the CPU: "loaded" (with the benchmark's max_perf)
    reaches the controller as /ready turns 200; a request routed and signed through the vastai client is served by
    the engine and deleted at the router; a bad signature and a plain request get 401; a restart with the same
    cache_dir reuses the cached benchmark (and, with an API key, plain requests need the bearer, routed ones not)."""
    import openai
    from openai.types import Completion
    from server_helpers import assert_error_body, start_server, stop_server, wait_ready_or_fail

    import worker.serve

    monkeypatch.setattr(vast.reporter, "STATUS_BUSY_INTERVAL_S", 1.0)  # the real cadence: "loaded" must not wait for it
    monkeypatch.delenv("USE_SSL", raising=False)
    cache_dir = tmp_path / "cache"
    # The real benchmark (serve's runs, concurrency and time bound, through the engine), its calls recorded.
    bench_calls: list[tuple[int, int]] = []
    bounded_benchmark = worker.serve.measure_max_perf_within

    async def recorded_benchmark(generate_fn, budget_s, runs, concurrency):
        bench_calls.append((runs, concurrency))
        return await bounded_benchmark(generate_fn, budget_s, runs, concurrency)

    monkeypatch.setattr(worker.serve, "measure_max_perf_within", recorded_benchmark)
    status_fields = [f.name for f in dataclasses.fields(WorkerStatusData)]

    def server_settings(ctl: Controller, **overrides: Any) -> Settings:
        port = free_port()
        monkeypatch.setenv(f"VAST_TCP_PORT_{port}", str(port))  # read by VastConfig.from_settings
        return Settings(model=str(tiny_model_dir), served_model_name="tiny-test", host="127.0.0.1", port=port,
                        device="cpu", dtype="float32", cache_dir=cache_dir, max_num_seqs=4, max_queue=64,
                        max_model_len=8192, hf_token=None, log_level="WARNING", idle_timeout_s=0.0,
                        controller_url=None, drain_grace_s=5.0, container_id=str(CONTAINER_ID),
                        report_addr=ctl.url, master_token=MTOKEN, public_ipaddr="127.0.0.1", unsecured=False,
                        vast_benchmark_s=BENCHMARK_S, **overrides)

    async def boot(ctl: Controller, **overrides: Any):
        """(server, its /ready body, the "loaded" status, seconds from /ready 200 to that status reaching ctl)."""
        settings = server_settings(ctl, **overrides)
        server = await asyncio.to_thread(start_server, settings, (), False)
        servers.append(server)
        await asyncio.to_thread(wait_ready_or_fail, server, 120.0)
        ready_at = time.monotonic()
        status, _, body = await asyncio.to_thread(server.get, "/ready")
        assert status == 200
        loaded = await ctl.wait_status(lambda s: s["loadtime"] > 0, timeout=5.0)
        lag = ctl.status_times[ctl.statuses.index(loaded)] - ready_at
        return server, json.loads(body), loaded, lag

    async def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.post(url, json=body, headers=headers or {}) as r:
                return r.status, await r.read()

    servers: list = []
    payload = {"model": "tiny-test", "prompt": "Hello from Vast", "max_tokens": 5, "temperature": 0.0,
               "ignore_eos": True}
    workload = workload_of(payload)  # ceil(15 / 4) + 5
    assert workload == 9

    async def main():
        # --- first start: benchmark measured, loaded reported, requests served and refused ----------------------
        async with Controller(router_key) as ctl:
            server, ready, loaded, lag = await boot(ctl)
            url = f"http://127.0.0.1:{server.settings.port}"
            # (1) "loaded" at once (not after the 1 s busy / 10 s idle timer), WorkerStatusData's fields exactly.
            assert lag < 0.5, f"loaded reached the controller {lag:.2f}s after /ready turned 200"
            assert list(loaded) == status_fields
            assert ctl.statuses[0]["loadtime"] == 0.0 and ctl.statuses[0]["max_perf"] == 0.0  # "loading" first
            assert loaded["max_perf"] > 0 and loaded["error_msg"] == "" and loaded["url"] == url
            assert (loaded["id"], loaded["mtoken"], loaded["version"]) == (CONTAINER_ID, MTOKEN, "1.1.0")
            bench_s = _stage_s(ready, "benchmark")
            assert loaded["loadtime"] >= bench_s > 0
            assert bench_s < BENCHMARK_S + 2.0, f"the benchmark ran {bench_s:.1f}s with a {BENCHMARK_S}s bound"
            cache = json.loads((cache_dir / "vast_benchmark.json").read_text())
            assert cache["max_perf"] == loaded["max_perf"] and cache["key"]["max_num_seqs"] == 4
            assert ctl.pubkey_gets >= 1 and bench_calls == [(3, 4)]  # serve's 3 rounds of max_num_seqs

            # (2) Routed and signed through the vastai client, served by the real engine.
            client, endpoint = vast_client(ctl)
            try:
                result = await endpoint.request("/v1/completions", payload, cost=workload)
            finally:
                await client.close()
            assert result["ok"] and result["status"] == 200 and result["url"] == url, result
            completion = Completion.model_validate(result["response"])
            assert completion.object == "text_completion" and completion.model == "tiny-test"
            assert len(completion.choices) == 1 and completion.choices[0].finish_reason == "length"
            assert completion.usage.completion_tokens == 5 and completion.usage.prompt_tokens > 0
            idx = ctl.routes[-1]["request_idx"]
            entry = await ctl.wait_delete(idx)
            assert entry["status"] == "Success" and entry["success"] is True
            assert entry["entered_queue_at"] <= entry["work_started_at"] <= entry["work_completed_at"]
            served = await ctl.wait_status(lambda s: s["cur_perf"] > 0)
            assert served["num_requests_recieved"] == 1 and served["cur_load"] == 0.0
            assert served["working_request_idxs"] == [] and served["max_perf"] == loaded["max_perf"]
            assert sum(s["cur_perf"] for s in ctl.statuses) == workload  # the benchmark does not count
            assert sum(s["new_load"] for s in ctl.statuses) == workload
            assert all(list(s) == status_fields for s in ctl.statuses)

            # (3) A bad signature (the router's key over another url; another key over ours): 401, never served.
            auth = {"url": url, "reqnum": 77, "signature": sign_url(router_key, "http://6.6.6.6:1"),
                    "endpoint": "glm-endpoint", "cost": workload, "request_idx": 7001, "__request_id": "bad"}
            status, body = await post(url + "/v1/completions", {"auth_data": auth, "payload": payload})
            assert status == 401, body
            assert_error_body(body, 401, code="invalid_signature")
            other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            forged = dict(auth, request_idx=7002, signature=sign_url(other, url))
            status, body = await post(url + "/v1/completions", {"auth_data": forged, "payload": payload})
            assert status == 401, body
            for bad_idx in (7001, 7002):
                assert (await ctl.wait_delete(bad_idx))["status"] == "Rejected"
            await ctl.wait_status(lambda s: s["rej_load"] > 0)
            await asyncio.sleep(1.2)  # one busy interval: every change reported
            assert sum(s["rej_load"] for s in ctl.statuses) == 2 * workload
            assert sum(s["cur_perf"] for s in ctl.statuses) == workload  # the refused ones were not served

            # (4) A plain OpenAI request (no auth_data) without UNSECURED or an API key: 401 (vast_auth_required).
            with openai.OpenAI(base_url=url + "/v1", api_key="anything", max_retries=0, timeout=30) as oc:
                with pytest.raises(openai.AuthenticationError) as err:
                    oc.completions.create(model="tiny-test", prompt="plain", max_tokens=2)
            assert err.value.status_code == 401 and err.value.code == "vast_auth_required"
            deleted = {e["request_idx"] for d in ctl.deletes for e in d["requests"]}
            assert deleted == {idx, 7001, 7002}  # a plain request is nobody's route: nothing to delete

            await asyncio.to_thread(stop_server, server)
            assert ctl.statuses[-1]["loadtime"] > 0  # the last report on the way out

        # --- (5) second start, same cache_dir: the cached benchmark, same max_perf, much faster --------------------
        async with Controller(router_key) as ctl:
            server2, ready2, loaded2, lag2 = await boot(ctl, api_key="sk-test")
            url2 = f"http://127.0.0.1:{server2.settings.port}"
            assert lag2 < 0.5 and list(loaded2) == status_fields
            assert loaded2["max_perf"] == loaded["max_perf"]
            bench2_s = _stage_s(ready2, "benchmark")
            assert bench_calls == [(3, 4)] and bench2_s < bench_s and bench2_s < 0.5, (bench2_s, bench_s)
            assert json.loads((cache_dir / "vast_benchmark.json").read_text())["measured_at"] == cache["measured_at"]
            # With an API key: plain requests need the bearer; routed ones carry the endpoint's key and pass on the
            # router's signature alone.
            status, body = await post(url2 + "/v1/completions", payload)
            assert status == 401, body
            assert_error_body(body, 401, code="invalid_api_key")
            status, body = await post(url2 + "/v1/completions", payload, {"Authorization": "Bearer sk-test"})
            assert status == 200, body
            assert Completion.model_validate_json(body).usage.completion_tokens == 5
            client, endpoint = vast_client(ctl)  # sends "Authorization: Bearer endpoint-key"
            try:
                result = await endpoint.request("/v1/completions", payload, cost=workload)
            finally:
                await client.close()
            assert result["status"] == 200 and result["url"] == url2, result
            assert Completion.model_validate(result["response"]).usage.completion_tokens == 5
            assert (await ctl.wait_delete(ctl.routes[-1]["request_idx"]))["status"] == "Success"
            await asyncio.to_thread(stop_server, server2)
        return bench_s, bench2_s

    try:
        bench_s, bench2_s = run(main())
    finally:
        for s in servers:
            if s.thread is not None and s.thread.is_alive():
                stop_server(s)
    print(f"benchmark {bench_s:.2f}s measured, {bench2_s:.3f}s cached")
