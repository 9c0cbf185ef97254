"""Refused requests get OpenAI error bodies with the right status, and the server keeps serving after each.

Uses the shared server and a small one (64-token context, an API key) for the limits and auth.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from server_helpers import (
    FAIL_MARKER, FAIL_MESSAGE, MODEL_NAME, assert_error_body, assert_serves, raw_stream, wait_until,
)

API_KEY = "sekrit-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def small(launch):
    """64-token context, two slots, an API key."""
    return launch(max_model_len=64, max_num_seqs=2, api_key=API_KEY)


# --- malformed and invalid bodies -----------------------------------------------------------------


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe{}", b'{"prompt": "x",}'])
def test_malformed_json_is_400(server, route, raw):
    status, headers, body = server.post(route, raw)
    assert status == 400, body
    assert headers["Content-Type"].startswith("application/json")
    assert_error_body(body, 400)
    assert_serves(server)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_body_must_be_an_object(server, route):
    status, _, body = server.post(route, b"[1, 2]")
    assert status == 400
    assert_error_body(body, 400, code="invalid_type")


@pytest.mark.parametrize("route,base", [(CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})])
@pytest.mark.parametrize("field,value,param", [
    ("temperature", "hot", "temperature"),
    ("temperature", 5, "temperature"),
    ("top_p", 0, "top_p"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "many", "max_tokens"),
    ("n", 17, "n"),
    ("n", 0, "n"),
    ("stop", 3, "stop"),
    ("seed", "abc", "seed"),
])
def test_invalid_fields_are_400_with_param(server, route, base, field, value, param):
    status, _, body = server.post(route, dict(base, **{field: value}))
    assert status == 400, body
    error = assert_error_body(body, 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert_serves(server)


def test_missing_messages_and_prompt(server):
    status, _, body = server.post(CHAT, {"model": MODEL_NAME})
    assert status == 400
    assert_error_body(body, 400, param="messages")
    status, _, body = server.post(COMPLETIONS, {"model": MODEL_NAME})
    assert status == 400
    assert_error_body(body, 400, param="prompt")


def test_bad_message_shape_names_the_param(server):
    status, _, body = server.post(CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "robot"}]})
    assert status == 400
    assert assert_error_body(body, 400)["param"].startswith("messages[1]")


def test_token_id_outside_vocabulary(server):
    status, _, body = server.post(COMPLETIONS, {"prompt": [1, 2, 100000], "max_tokens": 1})
    assert status == 400
    assert_error_body(body, 400, param="prompt")
    assert_serves(server)


def test_openai_client_raises_bad_request_with_param(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature="hot")
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


# --- model, routes --------------------------------------------------------------------------------


@pytest.mark.parametrize("route,base", [(CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})])
def test_unknown_model_is_404(server, route, base):
    status, _, body = server.post(route, dict(base, model="gpt-17"))
    assert status == 404
    assert_error_body(body, 404, param="model", code="model_not_found")
    assert_serves(server)


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_unknown_route_and_wrong_method(server):
    status, _, body = server.get("/v1/does-not-exist")
    assert status == 404
    assert_error_body(body, 404)
    status, _, body = server.get(CHAT)
    assert status == 405
    assert_error_body(body, 405)


# --- context limits -------------------------------------------------------------------------------


def test_prompt_longer_than_context_is_400(small):
    status, _, body = small.post(COMPLETIONS, {"prompt": "x" * 100, "max_tokens": 1}, headers=AUTH)
    assert status == 400, body
    assert_error_body(body, 400, param="prompt", code="context_length_exceeded")
    status, _, body = small.post(CHAT, {"messages": [{"role": "user", "content": "y" * 100}]}, headers=AUTH)
    assert status == 400, body
    assert_error_body(body, 400, param="messages", code="context_length_exceeded")
    assert_serves(small, headers=AUTH)


def test_prompt_filling_the_context_exactly_is_400(small):
    status, _, body = small.post(COMPLETIONS, {"prompt": [65] * 64, "max_tokens": 1}, headers=AUTH)
    assert status == 400, body
    assert_error_body(body, 400, code="context_length_exceeded")


@pytest.mark.parametrize("route,base", [(CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "hi"})])
def test_max_tokens_beyond_context_is_400(small, route, base):
    status, _, body = small.post(route, dict(base, max_tokens=64), headers=AUTH)
    assert status == 400, body
    assert_error_body(body, 400, param="max_tokens", code="context_length_exceeded")
    assert_serves(small, headers=AUTH)


def test_max_tokens_up_to_the_context_is_fine(small):
    # "hi" is 2 tokens: 62 more fit exactly.
    status, _, body = small.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 62, "ignore_eos": True,
                                               "temperature": 0}, headers=AUTH)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 62


def test_chat_without_max_tokens_gets_the_rest_of_the_context(small):
    status, _, body = small.post(CHAT, {"messages": MESSAGES, "ignore_eos": True}, headers=AUTH)
    assert status == 200, body
    usage = json.loads(body)["usage"]
    assert usage["total_tokens"] == 64


def test_max_tokens_beyond_context_on_the_big_server(server):
    status, _, body = server.post(CHAT, {"messages": MESSAGES, "max_tokens": 10**6})
    assert status == 400
    assert_error_body(body, 400, param="max_tokens", code="context_length_exceeded")


# --- auth -----------------------------------------------------------------------------------------


def test_api_key_required(small):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, body = small.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 1}, headers=headers)
        assert status == 401, (headers, body)
        error = assert_error_body(body, 401, code="invalid_api_key")
        assert error["type"] == "authentication_error"
        status, _, body = small.get("/v1/models", headers=headers)
        assert status == 401
    status, _, body = small.post(COMPLETIONS, {"prompt": "hi", "max_tokens": 1}, headers=AUTH)
    assert status == 200, body


def test_api_key_through_the_client(small):
    with openai.OpenAI(base_url=small.v1, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    with openai.OpenAI(base_url=small.v1, api_key=API_KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == [MODEL_NAME]
        response = good.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                                extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 2


def test_health_ready_metrics_are_open(small):
    for path in ("/health", "/ready", "/metrics"):
        status, _, _ = small.get(path)
        assert status == 200, path


def test_auth_rejections_are_counted(small):
    small.post(COMPLETIONS, {"prompt": "hi"})
    assert small.metric('glmflash_requests_total{route="/v1/completions",status="401"}') >= 1


# --- engine failures ------------------------------------------------------------------------------


def test_engine_step_failure_is_500_and_the_server_recovers(server):
    status, _, body = server.post(CHAT, {"messages": [{"role": "user", "content": FAIL_MARKER}], "max_tokens": 4})
    assert status == 500, body
    error = assert_error_body(body, 500)
    assert FAIL_MESSAGE in error["message"], error
    wait_until(lambda: server.metric("glmflash_state_slots_used") == 0, what="slots freed after the failure")
    assert_serves(server)


def test_engine_step_failure_while_streaming(server):
    request = {"messages": [{"role": "user", "content": FAIL_MARKER}], "max_tokens": 4, "stream": True}
    status, _, events = asyncio.run(raw_stream(server.url + CHAT, request))
    assert status == 200  # the stream had started: the failure arrives in it
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and FAIL_MESSAGE in errors[0]["error"]["message"], events
    wait_until(lambda: server.metric("glmflash_state_slots_used") == 0, what="slots freed after the failure")
    assert_serves(server)
