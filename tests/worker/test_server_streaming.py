"""Streams under load: concurrency, client disconnects, overload (429), readiness stages and metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import openai
import pytest

import worker.serve
from server_helpers import (
    MODEL_NAME, assert_error_body, assert_serves, read_sse, wait_until, wait_ready_or_fail,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG = 2000  # max_tokens of a stream that is closed long before it would end (~18 ms a token on CPU)


def _long_body(prompt: str = "a long story", **extra) -> dict:
    return dict({"model": MODEL_NAME, "prompt": prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True,
                 "temperature": 0}, **extra)


async def _open_stream(session: aiohttp.ClientSession, url: str, body: dict, events: int = 1):
    """POST a streaming request and read `events` data events; the response stays open."""
    response = await session.post(url, json=body)
    assert response.status == 200, await response.text()
    seen = b""
    while seen.count(b"\n\n") < events:
        chunk = await response.content.readany()
        assert chunk, "the stream ended early"
        seen += chunk
    return response


# --- concurrency ----------------------------------------------------------------------------------


def test_32_concurrent_streams_complete_and_match_sequential(server, client):
    prompts = [f"Prompt number {i}: tell me about {i * 7}" for i in range(32)]
    openai_prompts, raw_prompts = prompts[:24], prompts[24:]
    common = dict(model=MODEL_NAME, max_tokens=8, temperature=0)

    async def via_openai(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(prompt=prompt, stream=True, extra_body={"ignore_eos": True},
                                                  **common)
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        return text

    async def via_raw(session: aiohttp.ClientSession, prompt: str) -> str:
        body = dict(common, prompt=prompt, stream=True, ignore_eos=True)
        async with session.post(server.url + COMPLETIONS, json=body) as response:
            assert response.status == 200
            events = await read_sse(response)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as aclient, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*[via_openai(aclient, p) for p in openai_prompts],
                                        *[via_raw(session, p) for p in raw_prompts])

    concurrent = asyncio.run(run_all())
    sequential = [client.completions.create(prompt=p, extra_body={"ignore_eos": True}, **common).choices[0].text
                  for p in prompts]
    assert concurrent == sequential
    wait_until(lambda: server.metric("glmflash_state_slots_used") == 0, what="all slots free")


def test_concurrent_chat_streams_match_sequential(server, client):
    messages = [[{"role": "user", "content": f"chat {i}"}] for i in range(10)]
    common = dict(model=MODEL_NAME, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})

    async def one(aclient, m) -> str:
        stream = await aclient.chat.completions.create(messages=m, stream=True, **common)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*[one(aclient, m) for m in messages])

    concurrent = asyncio.run(run_all())
    sequential = [client.chat.completions.create(messages=m, **common).choices[0].message.content or ""
                  for m in messages]
    assert concurrent == sequential


# --- client disconnects ---------------------------------------------------------------------------


def _aborted(server) -> float:
    return server.metric("glmflash_requests_aborted_total")


def _idle(server) -> bool:
    m = server.metrics()
    return m.get("glmflash_state_slots_used") == 0 and m.get("glmflash_requests_running") == 0 \
        and m.get("glmflash_requests_waiting") == 0


@pytest.mark.parametrize("route,body", [
    (COMPLETIONS, _long_body()),
    (CHAT, {k: v for k, v in _long_body().items() if k != "prompt"} | {"messages": [{"role": "user", "content": "go"}]}),
])
def test_disconnect_mid_stream_aborts_the_request(server, route, body):
    before = _aborted(server)

    async def read_a_bit_then_leave():
        async with aiohttp.ClientSession() as session:
            response = await _open_stream(session, server.url + route, body, events=3)
            assert server.metric("glmflash_state_slots_used") >= 1
            response.close()  # drop the connection mid-stream

    asyncio.run(read_a_bit_then_leave())
    wait_until(lambda: _aborted(server) >= before + 1, what="the abort to be counted")
    wait_until(lambda: _idle(server), what="the slot to be freed")
    assert_serves(server)


def test_non_streaming_client_timeout_aborts_the_request(server):
    before = _aborted(server)
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=0.5) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=MODEL_NAME, prompt="slow", max_tokens=LONG,
                                         extra_body={"ignore_eos": True})
    wait_until(lambda: _aborted(server) >= before + 1, what="the abort to be counted")
    wait_until(lambda: _idle(server), what="the slot to be freed")
    assert_serves(server)


def test_disconnect_with_n2_aborts_both(server):
    before = _aborted(server)

    async def leave():
        async with aiohttp.ClientSession() as session:
            response = await _open_stream(session, server.url + COMPLETIONS, _long_body(n=2, temperature=1.0),
                                          events=4)
            assert server.metric("glmflash_state_slots_used") == 2
            response.close()

    asyncio.run(leave())
    wait_until(lambda: _aborted(server) >= before + 1, what="the abort to be counted")
    wait_until(lambda: _idle(server), what="both slots to be freed")


# --- overload -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy(launch):
    """One slot and a one-request queue: the third concurrent request is refused."""
    return launch(max_num_seqs=1, max_queue=1)


def test_full_queue_is_429_with_retry_after(busy):
    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            running = await _open_stream(session, busy.url + COMPLETIONS, _long_body("first"))
            # second: accepted (200 and the SSE headers), waits for the slot
            queued = await session.post(busy.url + COMPLETIONS, json=_long_body("second"))
            assert queued.status == 200
            wait_until(lambda: busy.metric("glmflash_requests_waiting") == 1, what="the second to be queued")
            rejected_before = busy.metric("glmflash_requests_rejected_total")

            async with session.post(busy.url + COMPLETIONS, json={"prompt": "third", "max_tokens": 2}) as third:
                assert third.status == 429
                assert third.headers.get("Retry-After", "").isdigit()
                error = assert_error_body(await third.read(), 429, code="queue_full")
                assert error["type"] == "rate_limit_error"
            async with session.post(busy.url + CHAT, json={"messages": [{"role": "user", "content": "x"}],
                                                           "stream": True}) as fourth:
                assert fourth.status == 429
                assert "Retry-After" in fourth.headers
            assert busy.metric("glmflash_requests_rejected_total") == rejected_before + 2
            assert busy.metric('glmflash_requests_total{route="/v1/completions",status="429"}') >= 1

            queued.close()
            running.close()

    asyncio.run(scenario())
    wait_until(lambda: _idle(busy), what="the busy server to be idle again")
    assert_serves(busy)


def test_429_through_the_openai_client(busy):
    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            running = await _open_stream(session, busy.url + COMPLETIONS, _long_body("first"))
            queued = await session.post(busy.url + COMPLETIONS, json=_long_body("second"))
            assert queued.status == 200
            with openai.OpenAI(base_url=busy.v1, api_key="x", max_retries=0) as c:
                with pytest.raises(openai.RateLimitError) as info:
                    await asyncio.to_thread(c.completions.create, model=MODEL_NAME, prompt="x", max_tokens=1)
                assert info.value.response.headers.get("retry-after")
            queued.close()
            running.close()

    asyncio.run(scenario())
    wait_until(lambda: _idle(busy), what="the busy server to be idle again")


def test_partially_queued_n2_request_is_withdrawn_on_429(busy):
    """n=2 with room for one: the whole request is refused and its first sample leaves the queue."""
    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            running = await _open_stream(session, busy.url + COMPLETIONS, _long_body("first"))
            async with session.post(busy.url + COMPLETIONS, json={"prompt": "two", "n": 2, "max_tokens": 2}) as r:
                assert r.status == 429
            # The queue has room again (once the engine thread took the abort): one request is accepted
            # while the first still runs. Were the first sample left queued, this would be 429 until the
            # long request ends, far past the deadline.
            deadline = time.monotonic() + 5
            while True:
                queued = await session.post(busy.url + COMPLETIONS, json=_long_body("next"))
                if queued.status == 200 or time.monotonic() > deadline:
                    break
                queued.close()
                await asyncio.sleep(0.05)
            assert queued.status == 200, "the refused n=2 request still holds the queue"
            assert busy.metric("glmflash_state_slots_used") == 1
            queued.close()
            running.close()

    asyncio.run(scenario())
    wait_until(lambda: _idle(busy), what="the busy server to be idle again")
    assert_serves(busy)


# --- readiness ------------------------------------------------------------------------------------


def test_ready_is_503_with_the_stage_while_loading(launch, monkeypatch):
    gate = threading.Event()
    provision_and_load = worker.serve.provision_and_load

    def gated(*args, **kwargs):  # hold the start before the model is provisioned and loaded
        assert gate.wait(30), "the test never released the load"
        return provision_and_load(*args, **kwargs)

    monkeypatch.setattr(worker.serve, "provision_and_load", gated)
    srv = launch(wait_ready=False)
    try:
        def not_ready():
            try:
                status, _, body = srv.get("/ready", timeout=2)
            except OSError:
                return None  # not listening yet
            return (status, json.loads(body)) if status == 503 else None

        status, body = wait_until(not_ready, timeout=30, what="/ready to answer 503")
        assert body["status"] == body["stage"] == "starting", body
        assert "model" not in body
        assert srv.get("/health")[0] == 200
        assert srv.get("/metrics")[0] == 200
        status, _, raw = srv.get("/v1/models")
        assert status == 503
        assert_error_body(raw, 503, code="not_ready")
        status, _, raw = srv.post(COMPLETIONS, {"prompt": "early", "max_tokens": 1})
        assert status == 503
        assert_error_body(raw, 503, code="not_ready")
        status, _, raw = srv.post(CHAT, {"messages": [{"role": "user", "content": "early"}], "stream": True})
        assert status == 503
        assert_error_body(raw, 503, code="not_ready")
    finally:
        gate.set()
    wait_ready_or_fail(srv)
    status, _, body = srv.get("/ready")
    assert status == 200
    payload = json.loads(body)
    assert payload["status"] == "ready" and payload["model"] == MODEL_NAME
    stages = [s["stage"] for s in payload["stages"]]
    assert stages[-2:] == ["warmup", "ready"], stages
    assert_serves(srv)


def test_ready_and_health_on_the_running_server(server):
    status, _, body = server.get("/ready")
    assert status == 200
    payload = json.loads(body)
    assert payload["status"] == "ready" and payload["model"] == MODEL_NAME
    status, _, body = server.get("/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


# --- metrics --------------------------------------------------------------------------------------

METRIC_NAMES = [
    "glmflash_requests_total", "glmflash_prompt_tokens_total", "glmflash_generation_tokens_total",
    "glmflash_requests_aborted_total", "glmflash_requests_rejected_total",
    "glmflash_time_to_first_token_seconds_count", "glmflash_inter_token_latency_seconds_count",
    "glmflash_requests_running", "glmflash_requests_waiting", "glmflash_state_slots_used",
    "glmflash_cache_usage_ratio",
]


def test_metrics_count_requests_and_tokens(server, client):
    before = server.metrics()
    response = client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = server.metrics()
    names = {key.split("{")[0] for key in after}
    for name in METRIC_NAMES:
        assert name in names, name
    route = 'glmflash_requests_total{route="/v1/completions",status="200"}'
    assert after[route] == before.get(route, 0) + 1
    assert after["glmflash_prompt_tokens_total"] - before["glmflash_prompt_tokens_total"] \
        == response.usage.prompt_tokens
    assert after["glmflash_generation_tokens_total"] - before["glmflash_generation_tokens_total"] == 5
    assert after["glmflash_time_to_first_token_seconds_count"] \
        == before["glmflash_time_to_first_token_seconds_count"] + 1
    # one gap per token after the first delta's; a delta may carry several tokens when the loop lags
    itl = after["glmflash_inter_token_latency_seconds_count"] - before["glmflash_inter_token_latency_seconds_count"]
    assert 0 <= itl <= 4
    assert 0.0 <= after["glmflash_cache_usage_ratio"] <= 1.0


def test_metrics_split_the_first_token_wait_into_queue_and_prefill(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt="where did the time go", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    gained = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert gained["glmflash_request_queue_time_seconds_count"] == 1
    assert gained["glmflash_request_prefill_time_seconds_count"] == 1
    queued, prefill = (gained[f"glmflash_request_{part}_time_seconds_sum"] for part in ("queue", "prefill"))
    assert 0 < prefill <= queued + prefill <= gained["glmflash_time_to_first_token_seconds_sum"]
    # the prompt in one prefill step (its first token), then a decode step for each of the other four
    assert gained['glmflash_engine_steps{kind="prefill"}'] == 1
    assert gained['glmflash_engine_steps{kind="decode"}'] == 4
    assert all(gained[f'glmflash_engine_step_seconds{{kind="{kind}"}}'] > 0 for kind in ("prefill", "decode"))


def test_metrics_show_a_running_request(server):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            response = await _open_stream(session, server.url + COMPLETIONS, _long_body("gauge"))
            m = wait_until(lambda: (lambda m: m if m["glmflash_requests_running"] == 1 else None)(server.metrics()),
                           what="the running gauge")
            assert m["glmflash_state_slots_used"] == 1
            assert m["glmflash_cache_usage_ratio"] > 0
            response.close()

    asyncio.run(scenario())
    wait_until(lambda: _idle(server), what="the slot to be freed")
