"""Tests for worker/protocol.py: request validation and OpenAI wire shapes.

Response objects are checked against the official ``openai`` package's types, so
the official client will parse what the server sends.
"""

from __future__ import annotations

import json

import pytest
from openai.types import Completion as OAICompletion
from openai.types import Model as OAIModel
from openai.types.chat import ChatCompletion as OAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OAIChatCompletionChunk
from pydantic import ValidationError

from worker import protocol as p
from worker.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionLogprobs,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    ProtocolError,
    ToolCall,
    TopLogprob,
    Usage,
    error_body,
    parse_request,
    validation_error_body,
)

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat(**fields):
    return {"model": "glm-5.3-flash", "messages": MSGS, **fields}


def completion(**fields):
    return {"model": "glm-5.3-flash", "prompt": "Once upon a time", **fields}


def error_of(model_cls, payload) -> dict:
    with pytest.raises(ProtocolError) as info:
        parse_request(model_cls, payload)
    assert info.value.status == 400
    body = info.value.body()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------------
# Requests: valid
# ---------------------------------------------------------------------------


def test_minimal_chat_request_defaults():
    req = parse_request(ChatCompletionRequest, {"messages": MSGS})
    assert req.model is None and req.n == 1 and req.stream is False
    assert req.temperature is None and req.effective_max_tokens is None
    assert req.logprobs is False and req.top_logprobs is None
    assert req.skip_special_tokens is True and req.ignore_eos is False
    assert req.stop_sequences == [] and req.include_usage is False
    assert req.enable_thinking is None


def test_full_chat_request():
    req = parse_request(
        ChatCompletionRequest,
        chat(
            messages=[
                {"role": "system", "content": "sys"},
                {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "thinking",
                    "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
            repetition_penalty=1.1, seed=1234, stop=["\n\n", "END"], stop_token_ids=[256], max_tokens=100,
            max_completion_tokens=50, n=2, stream=True, stream_options={"include_usage": True},
            logprobs=True, top_logprobs=5, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False}, skip_special_tokens=False,
            ignore_eos=True, user="u-1", response_format={"type": "text"},
        ),
    )
    assert req.effective_max_tokens == 50  # max_completion_tokens wins
    assert req.stop_sequences == ["\n\n", "END"]
    assert req.include_usage is True
    assert req.enable_thinking is False
    assert req.messages[2].text() == "ab"
    assert req.messages[3].tool_calls[0].function.arguments_dict() == {"city": "Bern"}
    assert req.messages[3].tool_calls[1].function.arguments_dict() == {"city": "Zürich"}
    assert req.tool_choice.function.name == "get_weather"
    dumped = req.template_messages()
    assert dumped[3] == {
        "role": "assistant",
        "reasoning_content": "thinking",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    }
    assert req.template_tools() == TOOLS


def test_unknown_fields_are_kept_not_rejected():
    req = parse_request(
        ChatCompletionRequest,
        chat(vendor_flag=True, extra_body={"x": 1},
             messages=[{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]),
    )
    assert req.model_extra == {"vendor_flag": True, "extra_body": {"x": 1}}
    assert req.messages[0].model_extra == {"cache_control": {"type": "ephemeral"}}


def test_explicit_nulls_mean_defaults():
    req = parse_request(ChatCompletionRequest, chat(n=None, stream=None, logprobs=None, temperature=None, stop=None))
    assert req.n == 1 and req.stream is False and req.logprobs is False


def test_image_parts_in_user_messages():
    parts = [{"type": "text", "text": "What is "},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             {"type": "text", "text": "?"},
             {"type": "image_url", "image_url": {"url": "https://x/b.png", "detail": "low"}}]
    req = parse_request(ChatCompletionRequest, chat(messages=[{"role": "user", "content": parts}]))
    assert req.messages[0].text() == "What is ?"
    assert [p.image_url.url for p in req.messages[0].content if p.type == "image_url"] == [
        "data:image/png;base64,AA", "https://x/b.png"]
    assert req.template_messages()[0]["content"][3] == {"type": "image_url",
                                                         "image_url": {"url": "https://x/b.png", "detail": "low"}}


def test_max_tokens_alone_and_stop_string():
    req = parse_request(ChatCompletionRequest, chat(max_tokens=7, stop="###"))
    assert req.effective_max_tokens == 7
    assert req.stop_sequences == ["###"]
    assert parse_request(ChatCompletionRequest, chat(stop=["", "x"])).stop_sequences == ["x"]


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_tool_choice_strings(choice):
    req = parse_request(ChatCompletionRequest, chat(tools=TOOLS, tool_choice=choice))
    assert req.tool_choice == choice


def test_tool_choice_none_and_auto_without_tools():
    assert parse_request(ChatCompletionRequest, chat(tool_choice="none")).tool_choice == "none"
    assert parse_request(ChatCompletionRequest, chat(tool_choice="auto")).tool_choice == "auto"


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("abc", ["abc"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = parse_request(CompletionRequest, completion(prompt=prompt))
    assert req.prompts == expected


def test_completion_request_fields():
    req = parse_request(
        CompletionRequest,
        completion(echo=True, logprobs=3, max_tokens=16, n=3, stream=True, stream_options={"include_usage": True},
                   temperature=0, best_of=1, suffix=None),
    )
    assert req.echo and req.logprobs == 3 and req.effective_max_tokens == 16 and req.include_usage


# ---------------------------------------------------------------------------
# Requests: invalid -> OpenAI error with the right param
# ---------------------------------------------------------------------------

CHAT_ERRORS = [
    # (payload, param, code)
    ({"model": "m"}, "messages", "missing_required_parameter"),
    (chat(messages=[]), "messages", "invalid_value"),
    (chat(messages="hi"), "messages", "invalid_type"),
    (chat(messages=[{"content": "hi"}]), "messages[0].role", "missing_required_parameter"),
    (chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role", "invalid_value"),
    (chat(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
    (chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]),
     "messages[0].content[0].type", "invalid_value"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/a.png"}]}]),
     "messages[0].content[0].image_url", "invalid_type"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "detail": "max"}}]}]),
     "messages[0].content[0].image_url.detail", "invalid_value"),
    (chat(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]", "invalid_value"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text", "invalid_type"),
    (chat(messages=[{"role": "user", "content": ["bare"]}]), "messages[0].content[0]", "invalid_type"),
    (chat(messages=[MSGS[0], {"role": "tool", "content": "r"}]), "messages[1].tool_call_id",
     "missing_required_parameter"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "x",
      "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]}]), "messages[1].tool_calls",
     "invalid_value"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{x"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0].function.name", "missing_required_parameter"),
    (chat(messages=[{"role": "assistant", "reasoning_content": 3}]), "messages[0].reasoning_content", "invalid_type"),
    (chat(temperature=2.5), "temperature", "invalid_value"),
    (chat(temperature=-0.1), "temperature", "invalid_value"),
    (chat(temperature="hot"), "temperature", "invalid_type"),
    (chat(top_p=0), "top_p", "invalid_value"),
    (chat(top_p=1.5), "top_p", "invalid_value"),
    (chat(top_k=-2), "top_k", "invalid_value"),
    (chat(min_p=1.5), "min_p", "invalid_value"),
    (chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),
    (chat(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
    (chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
    (chat(seed=2**64), "seed", "invalid_value"),
    (chat(seed="x"), "seed", "invalid_type"),
    (chat(stop=5), "stop", "invalid_type"),
    (chat(stop=["a", 1]), "stop[1]", "invalid_type"),
    (chat(stop_token_ids=[1, -1]), "stop_token_ids[1]", "invalid_value"),
    (chat(max_tokens=0), "max_tokens", "invalid_value"),
    (chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
    (chat(max_tokens=1.5), "max_tokens", "invalid_type"),
    (chat(n=0), "n", "invalid_value"),
    (chat(n=p.MAX_N + 1), "n", "invalid_value"),
    (chat(stream="yes please"), "stream", "invalid_type"),
    (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (chat(stream=True, stream_options={"include_usage": "maybe"}), "stream_options.include_usage", "invalid_type"),
    (chat(logprobs=5), "logprobs", "invalid_type"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs", "invalid_value"),
    (chat(top_logprobs=3), "top_logprobs", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", "missing_required_parameter"),
    (chat(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name", "invalid_value"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "nope"}}]),
     "tools[0].function.parameters", "invalid_type"),
    (chat(tools="x"), "tools", "invalid_type"),
    (chat(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (chat(tool_choice=3), "tool_choice", "invalid_type"),
    (chat(tool_choice="required"), "tool_choice", "invalid_value"),
    (chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice", "invalid_value"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice.function.name", "invalid_value"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {}}), "tool_choice.function.name",
     "missing_required_parameter"),
    (chat(parallel_tool_calls="x"), "parallel_tool_calls", "invalid_type"),
    (chat(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs", "invalid_type"),
    (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages", "invalid_value"),
    (chat(response_format={"type": "structural_tag"}), "response_format.type", "invalid_value"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "missing_required_parameter"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "missing_required_parameter"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "obj"}}),
     "response_format.json_schema.schema", "invalid_type"),
    (chat(response_format={}), "response_format.type", "missing_required_parameter"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "invalid_value"),
    (chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "invalid_value"),
    (chat(thinking_token_budget=-2), "thinking_token_budget", "invalid_value"),
    (chat(skip_special_tokens="maybe"), "skip_special_tokens", "invalid_type"),
    (chat(ignore_eos=[]), "ignore_eos", "invalid_type"),
    (chat(user=5), "user", "invalid_type"),
    (chat(model=5), "model", "invalid_type"),
]


@pytest.mark.parametrize("payload, param, code", CHAT_ERRORS, ids=[f"{e[1]}-{i}" for i, e in enumerate(CHAT_ERRORS)])
def test_chat_request_errors(payload, param, code):
    err = error_of(ChatCompletionRequest, payload)
    assert err["param"] == param, err
    assert err["code"] == code, err
    assert f"'{param}'" in err["message"]


COMPLETION_ERRORS = [
    ({"model": "m"}, "prompt", "missing_required_parameter"),
    (completion(prompt=[]), "prompt", "invalid_value"),
    (completion(prompt=5), "prompt", "invalid_type"),
    (completion(prompt=[1, "a"]), "prompt", "invalid_type"),
    (completion(prompt=[1, -2]), "prompt[1]", "invalid_value"),
    (completion(prompt=[[1], []]), "prompt[1]", "invalid_value"),
    (completion(prompt=[[1, "x"]]), "prompt[0][1]", "invalid_type"),
    (completion(suffix="tail"), "suffix", "invalid_value"),
    (completion(best_of=3), "best_of", "invalid_value"),
    (completion(echo="x"), "echo", "invalid_type"),
    (completion(logprobs=21), "logprobs", "invalid_value"),
    (completion(logprobs=-1), "logprobs", "invalid_value"),
    (completion(temperature=3), "temperature", "invalid_value"),
    (completion(top_p=0), "top_p", "invalid_value"),
    (completion(n=17), "n", "invalid_value"),
    (completion(max_tokens=0), "max_tokens", "invalid_value"),
    (completion(stop=[None]), "stop[0]", "invalid_type"),
    (completion(presence_penalty=9), "presence_penalty", "invalid_value"),
    (completion(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    (completion(guided_choice=[]), "guided_choice", "invalid_type"),
    (completion(guided_choice=["a", 1]), "guided_choice", "invalid_type"),
    (completion(guided_json="{x"), "guided_json", "invalid_value"),
    (completion(guided_json="[1]"), "guided_json", "invalid_type"),
    (completion(guided_regex="a", guided_choice=["b"]), "guided_choice", "invalid_value"),
    (completion(structured_outputs={}), "structured_outputs", "invalid_value"),
    (completion(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "invalid_value"),
    (completion(structured_outputs={"regex": "a", "structural_tag": "{}"}), "structured_outputs.structural_tag",
     "invalid_value"),
    (completion(structured_outputs={"json": 5}), "structured_outputs.json", "invalid_type"),
]


STRUCTURED = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("response_format", "json_object", True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": STRUCTURED, "strict": True}}},
     ("response_format.json_schema.schema", "json_schema", STRUCTURED)),
    ({"structured_outputs": {"json": json.dumps(STRUCTURED)}}, ("structured_outputs.json", "json_schema", STRUCTURED)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("structured_outputs.regex", "regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, ("structured_outputs.choice", "choice", ["x", "y"])),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ("structured_outputs.grammar", "grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, ("structured_outputs.json_object", "json_object", True)),
    ({"guided_json": STRUCTURED, "response_format": {"type": "text"}}, ("guided_json", "json_schema", STRUCTURED)),
    ({"guided_regex": "a+"}, ("guided_regex", "regex", "a+")),
    ({"guided_choice": ["x"]}, ("guided_choice", "choice", ["x"])),
    ({"guided_grammar": 'start: "x"'}, ("guided_grammar", "grammar", 'start: "x"')),
])
def test_structured_output_fields(fields, expected):
    for cls, payload in ((ChatCompletionRequest, chat(**fields)), (CompletionRequest, completion(**fields))):
        request = parse_request(cls, payload).structured_output
        assert (tuple(request) if request else None) == expected


@pytest.mark.parametrize(
    "payload, param, code", COMPLETION_ERRORS, ids=[f"{e[1]}-{i}" for i, e in enumerate(COMPLETION_ERRORS)]
)
def test_completion_request_errors(payload, param, code):
    err = error_of(CompletionRequest, payload)
    assert err["param"] == param, err
    assert err["code"] == code, err


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_non_object_body(body):
    err = error_of(ChatCompletionRequest, body)
    assert err["param"] is None
    assert "JSON object" in err["message"]


def test_validation_error_body_directly():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(chat(temperature=9))
    body = validation_error_body(info.value)
    assert body["error"]["param"] == "temperature"
    assert body["error"]["type"] == "invalid_request_error"
    assert "less than or equal to 2" in body["error"]["message"]


def test_error_body():
    assert error_body(400, "bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert error_body(404, "no such model", code="model_not_found")["error"] == {
        "message": "no such model", "type": "not_found_error", "param": None, "code": "model_not_found"
    }
    assert error_body(401, "x")["error"]["type"] == "authentication_error"
    assert error_body(429, "x")["error"]["type"] == "rate_limit_error"
    assert error_body(500, "x")["error"]["type"] == "server_error"
    assert error_body(503, "x")["error"]["type"] == "service_unavailable_error"
    assert error_body(400, "x", type="custom_error")["error"]["type"] == "custom_error"
    assert p.ErrorResponse.model_validate(error_body(400, "m")).model_dump() == error_body(400, "m")
    assert ProtocolError("gone", status=404).body()["error"]["type"] == "not_found_error"


def test_openai_client_request_shape_validates():
    """A request built from the openai SDK's own param types validates."""
    from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionToolMessageParam

    assistant: ChatCompletionAssistantMessageParam = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
    }
    tool: ChatCompletionToolMessageParam = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]}
    req = parse_request(ChatCompletionRequest, chat(messages=[MSGS[0], assistant, tool], tools=TOOLS))
    assert req.messages[2].text() == "ok"


# ---------------------------------------------------------------------------
# Responses: round trips through the openai package's types
# ---------------------------------------------------------------------------


def _roundtrip(oai_type, obj):
    data = obj.model_dump()
    parsed = oai_type.model_validate(data)
    assert parsed.model_dump(exclude_unset=True) == data
    parsed_json = oai_type.model_validate_json(obj.model_dump_json())
    assert parsed_json.model_dump(exclude_unset=True) == json.loads(obj.model_dump_json())
    return data, parsed


def _chat_logprobs():
    return ChatCompletionLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token="Hi", logprob=-0.1, bytes=[72, 105],
                top_logprobs=[TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105]),
                              TopLogprob(token="Hello", logprob=-2.5, bytes=[72, 101, 108, 108, 111])],
            ),
            ChatCompletionTokenLogprob(token="\ufffd", logprob=-1.0, bytes=None, top_logprobs=[]),
        ]
    )


def test_chat_completion_roundtrip():
    resp = ChatCompletionResponse(
        model="glm-5.3-flash",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatCompletionMessage(content="Hello!", reasoning_content="greet"),
                finish_reason="stop",
                logprobs=_chat_logprobs(),
            ),
            ChatCompletionChoice(
                index=1,
                message=ChatCompletionMessage(
                    content=None,
                    tool_calls=[ToolCall(id="call_x", function=FunctionCall(name="get_weather", arguments='{"city":"Bern"}'))],
                ),
                finish_reason="tool_calls",
            ),
        ],
        usage=Usage.of(10, 5, cached_tokens=4, reasoning_tokens=2),
    )
    data, parsed = _roundtrip(OAIChatCompletion, resp)
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert isinstance(data["created"], int)
    c0, c1 = data["choices"]
    assert c0["message"] == {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"}
    assert c0["logprobs"]["content"][1] == {"token": "\ufffd", "logprob": -1.0, "bytes": None, "top_logprobs": []}
    assert c1["logprobs"] is None  # OpenAI sends an explicit null
    assert c1["message"]["content"] is None and "content" in c1["message"]
    assert "reasoning_content" not in c1["message"]
    assert data["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert "system_fingerprint" not in data
    assert parsed.choices[1].message.tool_calls[0].function.name == "get_weather"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "Hello"
    assert parsed.choices[0].message.reasoning_content == "greet"  # extras survive in the SDK object
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_chunk_roundtrips():
    cid = p.random_id("chatcmpl")
    chunks = [
        ChatCompletionChunk(id=cid, model="m", choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]),
        ChatCompletionChunk(id=cid, model="m", choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(reasoning_content="hmm"))]),
        ChatCompletionChunk(
            id=cid, model="m",
            choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(content="Hi"), logprobs=_chat_logprobs())],
        ),
        ChatCompletionChunk(
            id=cid, model="m",
            choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(tool_calls=[
                DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="get_weather", arguments="")),
            ]))],
        ),
        ChatCompletionChunk(
            id=cid, model="m",
            choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(tool_calls=[
                DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"city": "Bern"}')),
            ]))],
        ),
        ChatCompletionChunk(id=cid, model="m", choices=[ChatCompletionChunkChoice(index=0, finish_reason="tool_calls")]),
        ChatCompletionChunk(id=cid, model="m", choices=[], usage=Usage.of(3, 4)),
    ]
    dumped = [_roundtrip(OAIChatCompletionChunk, c)[0] for c in chunks]
    first = dumped[0]["choices"][0]
    assert first == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert dumped[1]["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    assert dumped[3]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    ]
    assert dumped[4]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": '{"city": "Bern"}'}}]
    assert dumped[5]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert dumped[6]["choices"] == [] and dumped[6]["usage"]["total_tokens"] == 7
    assert all("usage" not in d for d in dumped[:6])
    assert all(d["object"] == "chat.completion.chunk" and d["id"] == cid for d in dumped)


def test_completion_roundtrip():
    resp = CompletionResponse(
        model="glm-5.3-flash",
        choices=[
            CompletionChoice(
                index=0, text=" there", finish_reason="length",
                logprobs=CompletionLogprobs(
                    tokens=[" ", "there"], token_logprobs=[-0.5, -0.25],
                    top_logprobs=[{" ": -0.5, "x": -3.0}, {"there": -0.25}], text_offset=[16, 17],
                ),
            ),
            CompletionChoice(index=1, text="!", finish_reason="stop"),
        ],
        usage=Usage.of(4, 2),
    )
    data, parsed = _roundtrip(OAICompletion, resp)
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"][1]["logprobs"] is None
    assert data["choices"][0]["logprobs"] == {
        "tokens": [" ", "there"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{" ": -0.5, "x": -3.0}, {"there": -0.25}], "text_offset": [16, 17],
    }
    assert parsed.choices[0].logprobs.text_offset == [16, 17]


def test_completion_echo_logprobs_keep_null_first_token():
    logprobs = CompletionLogprobs(tokens=["Once", " upon"], token_logprobs=[None, -1.5],
                                  top_logprobs=[None, {" upon": -1.5}], text_offset=[0, 4])
    assert logprobs.model_dump() == {
        "tokens": ["Once", " upon"], "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {" upon": -1.5}], "text_offset": [0, 4],
    }


def test_completion_chunk_roundtrip():
    cid = p.random_id("cmpl")
    mid = CompletionChunk(id=cid, model="m", choices=[CompletionChoice(index=0, text="Hel")])
    last = CompletionChunk(id=cid, model="m", choices=[CompletionChoice(index=0, text="lo", finish_reason="stop")])
    usage = CompletionChunk(id=cid, model="m", choices=[], usage=Usage.of(2, 2))
    assert mid.model_dump()["choices"][0] == {"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}
    # The SDK parses stream events leniently (finish_reason is null until the last one).
    from openai._models import construct_type

    parsed_mid = construct_type(type_=OAICompletion, value=json.loads(mid.model_dump_json()))
    assert parsed_mid.choices[0].text == "Hel" and parsed_mid.choices[0].finish_reason is None
    _roundtrip(OAICompletion, last)
    _roundtrip(OAICompletion, usage)


def test_model_list():
    cards = ModelList(data=[ModelCard(id="glm-5.3-flash", max_model_len=202752, root="/models/glm")])
    data = cards.model_dump()
    assert data["object"] == "list"
    card = data["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "glmflash" and card["max_model_len"] == 202752
    parsed = OAIModel.model_validate(card)
    assert parsed.id == "glm-5.3-flash"
    assert ModelCard(id="x").model_dump().keys() == {"id", "object", "created", "owned_by"}


def test_stop_reason_extension_is_optional():
    choice = ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="x"), finish_reason="stop", stop_reason="###")
    assert choice.model_dump()["stop_reason"] == "###"
    assert "stop_reason" not in ChatCompletionChoice(
        index=0, message=ChatCompletionMessage(content="x"), finish_reason="stop"
    ).model_dump()


def test_response_models_reject_bad_finish_reason():
    with pytest.raises(ValidationError):
        ChatCompletionChoice(index=0, message=ChatCompletionMessage(content="x"), finish_reason="abort")
    with pytest.raises(ValidationError):
        CompletionChoice(index=0, text="", finish_reason="tool_calls")
