"""Structured output end to end on a real server with the random tiny model (noise unless constrained):
every constrained answer must parse and validate, tool calls forced from the tools' schemas, the
reasoning budget, 400s for grammars that do not compile, and text_offset over multi-byte characters."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_helpers import MODEL_NAME, assert_error_body, assert_serves

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                                        "maxLength": 4}},
                   "required": ["ok", "note"], "additionalProperties": False},
        "level": {"enum": [1, 2, 3]},
    },
    "required": ["name", "age", "email", "tags", "nested"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["eco", "turbo"]}, "force": {"type": "boolean"}},
        "required": ["mode"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: takes none
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
           for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Fill in the form."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(launch):
    server = launch(max_num_seqs=16)  # no forcing processor: every row may take the sampler's fast path
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300) as c:
        c.server = server
        yield c


def chat(client, **kwargs):
    kwargs.setdefault("model", MODEL_NAME)
    kwargs.setdefault("messages", MESSAGES)
    return client.chat.completions.create(**kwargs)


def check_tool_calls(calls, allowed_names) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed_names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_all_validate(client, temperature):
    response = chat(client, response_format=JSON_FORMAT, n=8, max_tokens=300, temperature=temperature, seed=11,
                    extra_body=NO_THINKING)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    if temperature:
        assert len({c.message.content for c in response.choices}) > 1


def test_json_schema_after_reasoning(client):
    """Thinking on: free reasoning (at most half of max_tokens by default), then </think>, then the answer."""
    response = chat(client, response_format=JSON_FORMAT, n=2, max_tokens=300, temperature=1.0, seed=3,
                    logprobs=True)
    for choice in response.choices:
        assert choice.finish_reason == "stop" and choice.message.reasoning_content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        tokens = [entry.token for entry in choice.logprobs.content]
        assert tokens.index("</think>") <= 150


def test_streamed_json_schema_arrives_in_pieces_and_validates(client):
    stream = chat(client, response_format=JSON_FORMAT, max_tokens=300, temperature=1.0, seed=5, stream=True,
                  extra_body=NO_THINKING)
    pieces, reasons = [], []
    for chunk in stream:
        pieces += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert reasons == ["stop"] and len(pieces) > 5
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs", "response_format"])
def test_completions_with_a_schema(client, field):
    extra = {"guided_json": PERSON, "structured_outputs": {"json": PERSON}, "response_format": JSON_FORMAT}[field]
    response = client.completions.create(model=MODEL_NAME, prompt="Person:", max_tokens=300, n=2, temperature=1.0,
                                         seed=2, extra_body={field: extra})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    stream = client.completions.create(model=MODEL_NAME, prompt="Person:", max_tokens=300, temperature=1.0, seed=4,
                                       stream=True, extra_body={field: extra})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), PERSON)


def test_json_object_mode(client):
    """Any object: bounded only by max_tokens, so an answer cut by the limit ends with finish_reason 'length'."""
    response = chat(client, response_format={"type": "json_object"}, n=6, max_tokens=200, temperature=1.0, seed=9,
                    extra_body=NO_THINKING)
    finished = [c for c in response.choices if c.finish_reason == "stop"]
    assert finished, "no object was finished within max_tokens"
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice in response.choices:
        assert choice.message.content.startswith("{")


def test_choice_and_regex(client):
    choices = ["yes", "no", "peut-être"]
    response = chat(client, n=6, max_tokens=30, temperature=1.0, seed=1, extra_body={"guided_choice": choices,
                                                                                    **NO_THINKING})
    assert {c.message.content for c in response.choices} <= set(choices)
    pattern = r"[A-Z]{2}-[0-9]{2,4}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        response = client.completions.create(model=MODEL_NAME, prompt="Code:", n=4, max_tokens=30, temperature=1.0,
                                             extra_body=extra)
        for choice in response.choices:
            assert re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop", choice


def test_grammar_in_gbnf_and_lark(client):
    for grammar, pattern in (('root ::= "sum(" [0-9] "," [0-9] ")"', r"sum\([0-9],[0-9]\)"),
                             ('start: "x" ("+" NUM)*\nNUM: /[1-9]/', r"x(\+[1-9])*")):
        response = client.completions.create(model=MODEL_NAME, prompt="Expr:", n=4, max_tokens=60, temperature=1.0,
                                             seed=6, extra_body={"structured_outputs": {"grammar": grammar}})
        for choice in response.choices:
            if choice.finish_reason == "stop":
                assert re.fullmatch(pattern, choice.text), choice.text
            else:  # an unbounded repetition may run into max_tokens; what is there still follows the grammar
                assert re.fullmatch(pattern, choice.text[: choice.text.rfind("+")] or choice.text), choice.text


def test_logprobs_rank_only_the_allowed_tokens(client):
    response = chat(client, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=5,
                    extra_body={"guided_choice": ["yes", "no"], **NO_THINKING})
    first = response.choices[0].logprobs.content[0]
    assert {t.token for t in first.top_logprobs} == {"y", "n"}  # the mask leaves two candidates
    assert abs(sum(2.718281828459045 ** t.logprob for t in first.top_logprobs) - 1.0) < 1e-4


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_choice_required(client, thinking):
    extra = {} if thinking else NO_THINKING
    response = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4, max_tokens=160,
                    temperature=1.0, seed=8, extra_body=extra)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_tool_calls(choice.message.tool_calls, SCHEMAS)


def test_tool_choice_required_with_parallel_calls(client):
    response = chat(client, tools=TOOLS, tool_choice="required", n=4, max_tokens=400, temperature=1.0, seed=10,
                    extra_body=NO_THINKING)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        check_tool_calls(choice.message.tool_calls, SCHEMAS)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_named_tool_choice_streamed_and_whole(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = chat(client, tools=TOOLS, tool_choice=named, n=2, max_tokens=200, temperature=1.0, seed=12,
                    extra_body=NO_THINKING)
    for choice in response.choices:
        assert len(choice.message.tool_calls) == 1
        check_tool_calls(choice.message.tool_calls, {"get_weather"})
    stream = chat(client, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=1.0, seed=13, stream=True)
    calls, argument_pieces, reasons = {}, 0, []
    for chunk in stream:
        choice = chunk.choices[0]
        reasons += [choice.finish_reason] if choice.finish_reason else []
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
            if piece.function.arguments:
                call["arguments"] += piece.function.arguments
                argument_pieces += 1
    assert reasons == ["tool_calls"] and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert argument_pieces > 3  # streamed as generated, not in one piece at the end
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_thinking_token_budget(client):
    for budget in (0, 7):
        response = chat(client, max_tokens=40, temperature=1.0, seed=budget, logprobs=True,
                        extra_body={"thinking_token_budget": budget, "guided_choice": ["A", "B"]})
        choice = response.choices[0]
        tokens = [entry.token for entry in choice.logprobs.content]
        assert tokens.index("</think>") <= budget and choice.message.content in ("A", "B")
    # Without structured output the budget still ends the reasoning; what follows is free.
    response = chat(client, max_tokens=20, temperature=1.0, seed=4, logprobs=True,
                    extra_body={"thinking_token_budget": 5})
    assert "</think>" in [entry.token for entry in response.choices[0].logprobs.content][:6]


def test_max_tokens_cuts_a_structured_answer_with_length(client):
    response = chat(client, response_format=JSON_FORMAT, max_tokens=12, temperature=0.0, extra_body=NO_THINKING)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and response.usage.completion_tokens == 12
    assert choice.message.content.startswith('{"name": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize("extra, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}, "guided_json",
     "/missing"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "unclosed group"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "structured_outputs.grammar",
     "undefined_rule"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools", "nonsense"),
])
def test_grammars_that_do_not_compile_are_400s(client, extra, param, reason):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, **extra)
    error = assert_error_body(info.value.response.content, 400, param=param, code="invalid_grammar")
    assert reason in error["message"], error
    assert_serves(client.server)


def test_text_offset_counts_characters_inside_multibyte_text(client):
    text = "héllo wörld 日本 🎉!"
    expected = []  # the character each byte starts in
    for index, char in enumerate(text):
        expected += [index] * len(char.encode())
    response = client.completions.create(model=MODEL_NAME, prompt="Say:", max_tokens=40, temperature=0.0, logprobs=1,
                                         extra_body={"guided_choice": [text]})
    choice = response.choices[0]
    assert choice.text == text and choice.finish_reason == "stop"
    assert choice.logprobs.text_offset[:-1] == expected and choice.logprobs.text_offset[-1] == len(text)  # eos
    stream = client.completions.create(model=MODEL_NAME, prompt="Say:", max_tokens=40, temperature=0.0, logprobs=1,
                                       stream=True, extra_body={"guided_choice": [text]})
    offsets = [o for chunk in stream if chunk.choices for o in (chunk.choices[0].logprobs.text_offset or [])]
    assert offsets == choice.logprobs.text_offset
