"""Reasoning split and tool calls end to end: the server's forcing processor scripts the model's output.

A user message containing FORCE_MARKER makes the model write (token by token, through the real
engine, detokenizer and parsers) `I think.</think>Sure.<tool_call>get_weather<arg_key>city</arg_key>
<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>` and then eos;
with thinking off the template already closed the reasoning, and the script starts at `Sure.`.
"""

from __future__ import annotations

import json

import pytest

from server_helpers import CONTENT_TEXT, FORCE_MARKER, MODEL_NAME, REASONING_TEXT, SCRIPT_PLAIN, SCRIPT_THINKING

MESSAGES = [{"role": "user", "content": f"What is the weather in Paris for 3 days? {FORCE_MARKER}"}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}]
ARGUMENTS = {"city": "Paris", "days": 3}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def create(client, **kwargs):
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 100)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(**kwargs)


def accumulate(chunks):
    """Streamed chat deltas -> (reasoning, content, {index: call}, finish_reason, first pieces of each call)."""
    reasoning, content, calls, first, reason = "", "", {}, {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                first[piece.index] = piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None or piece.id == calls[piece.index]["id"]
                assert piece.function is None or piece.function.name in (None, calls[piece.index]["name"])
            if piece.function is not None and piece.function.arguments:
                calls[piece.index]["arguments"] += piece.function.arguments
        reason = choice.finish_reason or reason
    return reasoning, content, calls, reason, first


def test_forced_reasoning_and_tool_call(client, force_script):
    calls_before = force_script.calls
    response = create(client, tools=TOOLS)
    assert force_script.calls > calls_before, "the forcing processor did not run"
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING_TEXT
    assert choice.message.content == CONTENT_TEXT
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert response.usage.completion_tokens == len(SCRIPT_THINKING)


def test_forced_reasoning_and_tool_call_streamed(client):
    chunks = list(create(client, tools=TOOLS, stream=True, stream_options={"include_usage": True}))
    reasoning, content, calls, reason, first = accumulate(chunks)
    assert reasoning == REASONING_TEXT
    assert content == CONTENT_TEXT
    assert reason == "tool_calls"
    assert list(calls) == [0]
    assert first[0].id and first[0].type == "function" and first[0].function.name == "get_weather"
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS
    assert chunks[-1].usage.completion_tokens == len(SCRIPT_THINKING)


def test_streamed_and_whole_tool_calls_agree(client):
    whole = create(client, tools=TOOLS).choices[0].message.tool_calls[0]
    _, _, calls, _, _ = accumulate(create(client, tools=TOOLS, stream=True))
    assert calls[0]["arguments"] == whole.function.arguments
    assert calls[0]["name"] == whole.function.name


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_gives_content_and_no_reasoning(client, stream):
    if stream:
        reasoning, content, calls, reason, _ = accumulate(create(client, tools=TOOLS, stream=True,
                                                                 extra_body=NO_THINKING))
        args = json.loads(calls[0]["arguments"])
    else:
        response = create(client, tools=TOOLS, extra_body=NO_THINKING)
        message, reason = response.choices[0].message, response.choices[0].finish_reason
        reasoning, content = getattr(message, "reasoning_content", None), message.content
        args = json.loads(message.tool_calls[0].function.arguments)
        assert response.usage.completion_tokens == len(SCRIPT_PLAIN)
    assert not reasoning
    assert content == CONTENT_TEXT
    assert args == ARGUMENTS
    assert reason == "tool_calls"


def test_string_typed_parameter_stays_a_string(client):
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["parameters"]["properties"]["days"] = {"type": "string"}
    call = create(client, tools=tools).choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": "3"}


def test_without_tools_the_markup_stays_in_content(client):
    response = create(client)
    message = response.choices[0].message
    assert message.reasoning_content == REASONING_TEXT
    assert message.tool_calls is None
    assert message.content.startswith(CONTENT_TEXT + "<tool_call>get_weather")
    assert response.choices[0].finish_reason == "stop"


def test_tool_choice_none_disables_parsing(client):
    response = create(client, tools=TOOLS, tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"
    assert "<tool_call>" in response.choices[0].message.content


def test_forcing_is_scoped_to_the_marker(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "plain"}],
                                              tools=TOOLS, max_tokens=len(SCRIPT_THINKING), temperature=0,
                                              extra_body={"ignore_eos": True})
    message = response.choices[0].message
    assert message.reasoning_content != REASONING_TEXT
