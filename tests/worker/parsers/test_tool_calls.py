"""GLM tool-call parsing: typed arguments, malformed output, and streaming parity for every split."""

from __future__ import annotations

import json
from typing import Any

import pytest

from worker.parsers import TOOL_PARSERS, GlmToolParser, ToolCall

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "options": {"type": "object"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "ratio": {"type": "number"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "label": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]

TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def call(name: str, **pairs: str) -> str:
    """GLM-4.7/5 markup for one call (no newlines)."""
    args = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
    return f"<tool_call>{name}{args}</tool_call>"


Result = tuple[str | None, list[tuple[str, Any]]]


def _decoded(content: str | None, calls: list[ToolCall]) -> Result:
    """Content and (name, arguments) with arguments JSON-decoded where they are complete JSON."""
    out = []
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        try:
            out.append((c.name, json.loads(c.arguments)))
        except json.JSONDecodeError:
            out.append((c.name, c.arguments))
    return content, out


def _stream(chunks: list[str], tools: list[dict[str, Any]] | None = TOOLS) -> tuple[str | None, list[ToolCall]]:
    """Feed chunks, check the OpenAI streaming shape and reassemble the result."""
    parser = GlmToolParser(tools)
    content = ""
    calls: dict[int, list[str]] = {}
    for delta in [*map(parser.feed, chunks), parser.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.index == len(calls), "indices are dense and in order"
                assert piece.id and piece.type == "function" and piece.name, "first piece names the call"
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert piece.id is None and piece.name is None and piece.type is None
            calls[piece.index][2] += piece.arguments
    return content or None, [ToolCall(id=i, name=n, arguments=a) for i, n, a in calls.values()]


def _splits(text: str) -> list[list[str]]:
    """Every cut into two deltas, plus one delta per character."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


CASES: list[tuple[str, str, Result]] = [
    (
        "typed by schema",
        call(
            "get_weather",
            city="Beijing",
            zip="01234",
            days="3",
            metric="true",
            options='{"unit": "c", "detail": [1, 2]}',
            hours="[9, 12]",
            ratio="0.5",
        ),
        (
            None,
            [
                (
                    "get_weather",
                    {
                        "city": "Beijing",
                        "zip": "01234",
                        "days": 3,
                        "metric": True,
                        "options": {"unit": "c", "detail": [1, 2]},
                        "hours": [9, 12],
                        "ratio": 0.5,
                    },
                )
            ],
        ),
    ),
    (
        "string param keeps digits, quotes, spaces and JSON-looking text raw",
        call("get_weather", city=" 42 ", zip='"123"', note="{}", label="null"),
        (None, [("get_weather", {"city": " 42 ", "zip": '"123"', "note": "{}", "label": "null"})]),
    ),
    (
        "python literals accepted for non-string types, like vLLM/SGLang",
        call("get_weather", metric="True", options="{'unit': 'c', 'n': None}", hours="(1, 2)"),
        (None, [("get_weather", {"metric": True, "options": {"unit": "c", "n": None}, "hours": [1, 2]})]),
    ),
    (
        "non-string value that is neither JSON nor a literal stays a string",
        call("get_weather", days="three", ratio="NaN", hours="{1, 2}"),
        (None, [("get_weather", {"days": "three", "ratio": "NaN", "hours": "{1, 2}"})]),
    ),
    (
        "escaping and unicode in a streamed string",
        call("write_file", path="a.py", content='print("hi\\n")\n\tx = "北京" </arg \u2028'),
        (None, [("write_file", {"path": "a.py", "content": 'print("hi\\n")\n\tx = "北京" </arg \u2028'})]),
    ),
    (
        "content before, several calls, zero-arg call",
        "Let me check both.\n\n" + call("get_weather", city="Paris") + "\n" + call("get_time"),
        ("Let me check both.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ),
    (
        "content between and after calls",
        "A < B " + call("get_time") + " and then " + call("get_time") + "\nDone <tool",
        ("A < B  and then \nDone <tool", [("get_time", {}), ("get_time", {})]),
    ),
    (
        "GLM-4.5 newline layout",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        (None, [("get_weather", {"city": "北京", "days": 2})]),
    ),
    (
        "newline before the name, literal \\n separators, spaces in key",
        "<tool_call>\nget_weather\\n<arg_key> city </arg_key>\\n<arg_value>Oslo</arg_value>\\n</tool_call>",
        (None, [("get_weather", {"city": "Oslo"})]),
    ),
    (
        "unknown function: forwarded, values inferred",
        call("search_web", query="cats", limit="5", safe="false"),
        (None, [("search_web", {"query": "cats", "limit": 5, "safe": False})]),
    ),
    (
        "unknown parameter of a known tool is inferred",
        call("get_weather", city="Rome", extra="[1]"),
        (None, [("get_weather", {"city": "Rome", "extra": [1]})]),
    ),
    (
        "missing </tool_call> at the end after a complete pair: closed",
        "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lima</arg_value>\n",
        ("Checking.", [("get_weather", {"city": "Lima"})]),
    ),
    (
        "cut inside a string value: arguments stay as streamed (unterminated)",
        "<tool_call>write_file<arg_key>path</arg_key><arg_value>a.py</arg_value>"
        "<arg_key>content</arg_key><arg_value>line1\nline",
        (None, [("write_file", '{"path": "a.py", "content": "line1\\nline')]),
    ),
    (
        "cut inside a non-string value: that pair is not written",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lima</arg_value><arg_key>days</arg_key><arg_value>1",
        (None, [("get_weather", '{"city": "Lima"')]),
    ),
    (
        "cut inside the name: no call, no markup in content",
        "Let me look.\n<tool_call>get_wea",
        ("Let me look.", []),
    ),
    (
        "missing </tool_call> before the next call",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Kyiv</arg_value>" + call("get_time"),
        (None, [("get_weather", {"city": "Kyiv"}), ("get_time", {})]),
    ),
    (
        "key without a value is dropped, junk between pairs ignored",
        "<tool_call>get_weather<arg_key>days</arg_key><arg_key>city</arg_key>junk<arg_value>Nice</arg_value>"
        " more junk <arg_key>metric</arg_key></tool_call>",
        (None, [("get_weather", {"city": "Nice"})]),
    ),
    (
        "value without </arg_value>: kept with what it has",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Bern</tool_call>"
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4</tool_call>",
        (None, [("get_weather", {"city": "Bern"}), ("get_weather", {"days": 4})]),
    ),
    (
        "stray tag after a no-argument name (GLM 5.2 in the wild)",
        "<tool_call>get_time</arg_value></tool_call>",
        (None, [("get_time", {})]),
    ),
    (
        "empty name: the call is dropped",
        "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call><tool_call> </tool_call>ok",
        ("ok", []),
    ),
    (
        "whitespace at the edges touching calls is dropped, inner whitespace kept",
        " \n" + call("get_time") + "\n\nFirst, " + call("get_time") + "\n second.\n" + call("get_time") + " \n",
        ("First, \n second.", [("get_time", {}), ("get_time", {}), ("get_time", {})]),
    ),
    ("only whitespace around a call", "\n" + call("get_time") + "\n", (None, [("get_time", {})])),
    (
        "stray </tool_call> in content is dropped",
        "done</tool_call> here",
        ("done here", []),
    ),
    (
        "repeated key written twice, last one wins when decoded",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>A</arg_value>"
        "<arg_key>city</arg_key><arg_value>B</arg_value></tool_call>",
        (None, [("get_weather", {"city": "B"})]),
    ),
    (
        "GLM-5.3 JSON form: arguments kept exactly as generated",
        '<tool_call>get_weather>{"city": "Paris", "days": 3, "options": {"a": [1, {"b": null}]}}',
        (None, [("get_weather", {"city": "Paris", "days": 3, "options": {"a": [1, {"b": None}]}})]),
    ),
    (
        "JSON form: content before, optional </tool_call> after",
        "Sure.\n<tool_call>get_time>{}</tool_call>",
        ("Sure.", [("get_time", {})]),
    ),
    (
        "JSON form: calls back to back, content after",
        '<tool_call>get_time>{}<tool_call>get_weather>{"city": "Oslo"}\nDone.',
        ("Done.", [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ),
    (
        "JSON form: braces, escaped quotes, backslashes and tags inside strings",
        '<tool_call>write_file>{"path": "a}b]", "content": "x \\"}\\" \\\\ <tool_call> {"}',
        (None, [("write_file", {"path": "a}b]", "content": 'x "}" \\ <tool_call> {'})]),
    ),
    (
        "JSON form: whitespace before the object, namespaced name of a known tool",
        '<tool_call>Weather/get_weather> \n{"city": "Rome"}',
        (None, [("get_weather", {"city": "Rome"})]),
    ),
    (
        "JSON form: unknown namespaced name forwarded",
        "<tool_call>Web/search>{}",
        (None, [("Web/search", {})]),
    ),
    (
        "JSON form: no object after the name: no arguments, the rest is content",
        "<tool_call>get_time>then text",
        ("then text", [("get_time", {})]),
    ),
    (
        "JSON form: cut inside the arguments: kept as generated",
        '<tool_call>get_weather>{"city": "Li',
        (None, [("get_weather", '{"city": "Li')]),
    ),
    ("JSON form: cut right after the name", "<tool_call>get_time>", (None, [("get_time", {})])),
    (
        "JSON form: a tag outside strings ends unfinished arguments",
        '<tool_call>get_weather>{"city": 1 <tool_call>get_time>{}',
        (None, [("get_weather", '{"city": 1 '), ("get_time", {})]),
    ),
    (
        "JSON form: empty name: the call is dropped",
        '<tool_call>>{"a": "}"} ok',
        ("ok", []),
    ),
    (
        "both forms in one output",
        call("get_weather", city="Kyiv") + '<tool_call>get_weather>{"city": "Lviv"}',
        (None, [("get_weather", {"city": "Kyiv"}), ("get_weather", {"city": "Lviv"})]),
    ),
    ("plain text untouched", "  Just text, 1 < 2 > 0.\n", ("  Just text, 1 < 2 > 0.\n", [])),
    ("empty output", "", (None, [])),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_extract(text: str, expected: Result) -> None:
    assert _decoded(*GlmToolParser(TOOLS).extract(text)) == expected


@pytest.mark.parametrize("text", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_streaming_matches_extract_for_every_split(text: str) -> None:
    content, calls = GlmToolParser(TOOLS).extract(text)
    expected = (content, [(c.name, c.arguments) for c in calls])
    for chunks in _splits(text):
        got_content, got_calls = _stream(chunks)
        assert (got_content, [(c.name, c.arguments) for c in got_calls]) == expected, chunks
        assert not any(tag in (got_content or "") for tag in TAGS), chunks


def test_arguments_are_exactly_json_dumps_of_the_dict() -> None:
    text = call("get_weather", city="Zürich", days="2", options='{"a": [1, {"b": null}]}')
    (tool_call,) = GlmToolParser(TOOLS).extract(text)[1]
    expected = {"city": "Zürich", "days": 2, "options": {"a": [1, {"b": None}]}}
    assert tool_call.arguments == json.dumps(expected, ensure_ascii=False)


def test_no_tools_given_infers_every_value() -> None:
    text = call("get_weather", city="Paris", zip="75001", metric="false")
    for tools in (None, []):
        content, calls = GlmToolParser(tools).extract(text)
        assert _decoded(content, calls) == (None, [("get_weather", {"city": "Paris", "zip": 75001, "metric": False})])
        assert _decoded(*_stream(list(text), tools)) == _decoded(content, calls)


def test_ids_are_unique() -> None:
    calls = GlmToolParser(TOOLS).extract(call("get_time") * 3)[1]
    assert len({c.id for c in calls}) == 3


def test_arguments_stream_before_the_call_ends() -> None:
    parser = GlmToolParser(TOOLS)
    first = parser.feed("Sure.<tool_call>write_file<arg_key>path</arg_key>")
    assert first.content == "Sure."
    assert [(p.index, p.name, p.arguments) for p in first.tool_calls] == [(0, "write_file", "")]
    # A string value streams while it is generated; a partial closing tag is held back.
    assert parser.feed("<arg_value>a.py</arg_val").tool_calls[0].arguments == '{"path": "a.py'
    assert parser.feed("ue>").tool_calls[0].arguments == '"'
    delta = parser.feed("<arg_key>content</arg_key><arg_value>x = 1\n")
    assert delta.tool_calls[0].arguments == ', "content": "x = 1\\n'
    # A typed value is written once its pair is complete, before </tool_call>.
    parser = GlmToolParser(TOOLS)
    parser.feed("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1")
    assert parser.feed("0</arg_value>").tool_calls[0].arguments == '{"days": 10'
    assert parser.feed("</tool_call>").tool_calls[0].arguments == "}"


def test_json_form_arguments_stream_as_generated() -> None:
    parser = GlmToolParser(TOOLS)
    first = parser.feed("<tool_call>get_weather>")
    assert [(p.index, p.name, p.arguments) for p in first.tool_calls] == [(0, "get_weather", "")]
    assert parser.feed('{"city": "Pa').tool_calls[0].arguments == '{"city": "Pa'
    assert parser.feed('ris", "days": 2 <tool_').tool_calls[0].arguments == 'ris", "days": 2 '  # a tag may follow
    assert parser.feed("bar}").tool_calls[0].arguments == "<tool_bar}"
    assert parser.feed(" after").content == "after"


def test_content_never_includes_a_partial_tag() -> None:
    parser = GlmToolParser(TOOLS)
    assert parser.feed("Hi <tool_").content == "Hi"  # trailing space held too: a call may follow
    delta = parser.feed("call>get_time</tool_call>")
    assert delta.content == "" and delta.tool_calls[0].name == "get_time"
    assert parser.feed(" <tool").content == ""
    assert parser.feed("box>").content == "  <toolbox>"  # inner whitespace is content


def test_registry() -> None:
    assert TOOL_PARSERS["glm45"] is GlmToolParser
    assert TOOL_PARSERS["glm47"] is GlmToolParser
