"""POST /tokenize and /detokenize on a real server, as vLLM serves them: the ids and count a chat or text prompt
costs (equal to what the completion endpoints charge, and to transformers' tokenizer and chat template), token
strings, the round trip, and bad input answered with a 400 that names the field."""

from __future__ import annotations

import json

import pytest

from server_helpers import MODEL_NAME

from test_server_openai import IGNORE_EOS, MESSAGES, chat_prompt_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = server.post(path, body)
    return status, json.loads(raw)


@pytest.mark.parametrize("special", [False, True])
def test_a_text_prompt_gives_the_tokenizers_ids_and_strings(server, tokenizer, special):
    text = "Count me, agents: héllo wörld 123"
    status, body = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text, "add_special_tokens": special,
                                              "return_token_strs": True})
    assert status == 200, body
    want = tokenizer(text, add_special_tokens=special)["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(want)
    models = json.loads(server.get("/v1/models")[2])
    assert body["max_model_len"] == models["data"][0]["max_model_len"]
    status, plain = post(server, "/tokenize", {"prompt": text})
    assert "token_strs" in plain and plain["token_strs"] is None  # vLLM's shape: present, null unless asked


def test_the_count_is_what_a_completion_charges(server, client):
    text = "The prompt an agent budgets for."
    _, body = post(server, "/tokenize", {"prompt": text})
    usage = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1, temperature=0).usage
    assert body["count"] == usage.prompt_tokens


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_messages_are_rendered_as_a_chat_completion_renders_them(server, client, tokenizer, tools):
    request = {"messages": MESSAGES, **({"tools": tools} if tools else {})}
    status, body = post(server, "/tokenize", request)
    assert status == 200, body
    assert body["tokens"] == chat_prompt_ids(tokenizer, MESSAGES, **({"tools": tools} if tools else {}))
    usage = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0,
                                           extra_body=IGNORE_EOS, **({"tools": tools} if tools else {})).usage
    assert body["count"] == usage.prompt_tokens
    _, bare = post(server, "/tokenize", {**request, "add_generation_prompt": False})
    want = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False,
                                         **({"tools": tools} if tools else {}))
    assert bare["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    _, quiet = post(server, "/tokenize", {**request, "chat_template_kwargs": {"enable_thinking": False}})
    assert quiet["tokens"] == chat_prompt_ids(tokenizer, MESSAGES, enable_thinking=False,
                                              **({"tools": tools} if tools else {}))


def test_detokenize_inverts_tokenize(server):
    text = "round trip: ünïcode and <b>markup</b>"
    _, ids = post(server, "/tokenize", {"prompt": text})
    status, body = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": ids["tokens"]})
    assert status == 200 and body == {"prompt": text}


@pytest.mark.parametrize("path,request_body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/detokenize", {"tokens": [1, -3]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, path, request_body, param):
    status, body = post(server, path, request_body)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"].startswith(param), body
    assert post(server, "/tokenize", {"prompt": "still here"})[0] == 200


def test_another_model_is_a_404(server):
    status, body = post(server, "/tokenize", {"model": "not-this-one", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
