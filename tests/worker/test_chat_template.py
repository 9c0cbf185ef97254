"""Tests for worker/chat_template.py.

Oracle: transformers' ``AutoTokenizer.apply_chat_template(..., tokenize=False)``
on the tiny model's tokenizer files must give exactly the string we render.
"""

from __future__ import annotations

import copy
import datetime
import json
import pathlib

import pytest
import transformers

from engine.tiny.tokenizer import write_tokenizer
from worker.chat_template import (
    ChatTemplate,
    RenderedPrompt,
    TemplateError,
    normalize_messages,
    prompt_ends_in_reasoning,
)
from worker.protocol import ChatCompletionRequest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — returns °C",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "days": {"type": "integer", "default": None},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "description": "Web search", "parameters": {"type": "object", "properties": {}}},
    },
]

WEATHER_ARGS = {"city": "Zürich", "days": 3, "units": ["c", "f"], "verbose": False, "extra": None}


def _assistant_call(arguments, *, content=None, reasoning=None, call_id="call_1"):
    msg = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        ],
    }
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny_snapshot")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def oracle(snapshot):
    return transformers.AutoTokenizer.from_pretrained(str(snapshot))


@pytest.fixture(scope="module")
def template(snapshot) -> ChatTemplate:
    return ChatTemplate.from_dir(snapshot)


def _oracle(tok, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
    return tok.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=add_generation_prompt,
        tokenize=False, **kwargs,
    )


def _decoded(messages):
    """The oracle's input: tool-call arguments as dicts (transformers does not decode JSON strings)."""
    out = copy.deepcopy(messages)
    for msg in out:
        for call in msg.get("tool_calls") or []:
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
    return out


CASES = {
    "plain": dict(messages=[{"role": "user", "content": "Hello!"}]),
    "system": dict(
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    ),
    "developer": dict(
        messages=[{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    ),
    "thinking_off": dict(messages=[{"role": "user", "content": "Hello"}], kwargs={"enable_thinking": False}),
    "thinking_on": dict(messages=[{"role": "user", "content": "Hello"}], kwargs={"enable_thinking": True}),
    "no_generation_prompt": dict(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
        add_generation_prompt=False,
    ),
    "tools": dict(messages=[{"role": "user", "content": "Weather in Zürich?"}], tools=TOOLS),
    "tools_empty_list": dict(messages=[{"role": "user", "content": "Hi"}], tools=[]),
    "tool_calls_json_string": dict(
        messages=[
            {"role": "user", "content": "Weather in Zürich?"},
            _assistant_call(json.dumps(WEATHER_ARGS, ensure_ascii=False)),
        ],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    "tool_calls_empty_arguments": dict(
        messages=[{"role": "user", "content": "Search"}, _assistant_call("")],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    "tool_results": dict(
        messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Zürich and Bern?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "reasoning_content": "Two cities, two calls.",
                "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                    {"id": "b", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Bern", "days": 2}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": '{"temp": 12}'},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": '{"temp": 9}'}]},
        ],
        tools=TOOLS,
    ),
    "content_parts": dict(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
        ]
    ),
    "multi_turn_reasoning": dict(
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "  Again simple.  "},
            {"role": "user", "content": "Thanks"},
        ]
    ),
    "multi_turn_reasoning_kept": dict(
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
            {"role": "user", "content": "And 3+3?"},
        ],
        kwargs={"clear_thinking": False},
    ),
    "reasoning_after_last_user": dict(
        messages=[
            {"role": "user", "content": "Weather?"},
            _assistant_call('{"city": "Bern"}', reasoning="Need the tool."),
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=TOOLS,
    ),
    "reasoning_alias_field": dict(
        messages=[
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "reasoning": "thought via 'reasoning'"},
        ],
        add_generation_prompt=False,
    ),
    "reasoning_inline_in_content": dict(
        messages=[
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>inline thought</think>A"},
        ],
        add_generation_prompt=False,
    ),
    "none_fields_dropped": dict(
        messages=[
            {"role": "user", "content": "Q", "name": None},
            _assistant_call('{"city": "Bern"}', content=None),
        ],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    "unicode_and_markup": dict(
        messages=[{"role": "user", "content": "Ünïcødé ✓ <b>tags</b> {{ not jinja }} 中文"}],
    ),
    "images": dict(
        messages=[
            {"role": "system", "content": [{"type": "image"}, {"type": "text", "text": "Describe images."}]},
            {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                         {"type": "text", "text": " and "}, {"type": "image"}]},
            {"role": "assistant", "content": "They differ."},
            {"role": "user", "content": [{"type": "image"}]},
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(name, template, oracle):
    case = CASES[name]
    messages = case["messages"]
    tools = case.get("tools")
    agp = case.get("add_generation_prompt", True)
    kwargs = case.get("kwargs", {})
    original = copy.deepcopy(messages)
    ours = template.render(messages, tools=tools, add_generation_prompt=agp, **kwargs)
    expected = _oracle(oracle, _decoded(messages), tools=tools, add_generation_prompt=agp, **kwargs)
    assert isinstance(ours, str)
    assert str(ours) == expected
    assert messages == original, "render must not mutate its input"


def test_pydantic_request_messages_match(template, oracle):
    case = CASES["tool_results"]
    request = ChatCompletionRequest.model_validate(
        {"model": "glm", "messages": case["messages"], "tools": case["tools"]}
    )
    ours = template.render(request.template_messages(), tools=request.template_tools())
    expected = _oracle(oracle, _decoded(case["messages"]), tools=case["tools"])
    assert ours == expected
    # The models themselves are accepted too.
    assert template.render(request.messages, tools=request.tools) == expected


def test_expected_prompt_literal(template):
    prompt = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert prompt == "[gMASK]<sop><|system|>S<|user|>Hi<|assistant|><think>"
    calls = template.render(
        [{"role": "user", "content": "Q"}, _assistant_call('{"city": "Bern", "days": 2}')],
        add_generation_prompt=False,
    )
    assert calls.endswith(
        "<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Bern</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    )


def test_ends_in_reasoning(template):
    on = template.render([{"role": "user", "content": "Hi"}])
    off = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert isinstance(on, RenderedPrompt)
    assert on.ends_in_reasoning is True
    assert off.ends_in_reasoning is False
    assert template.ends_in_reasoning(on) and not template.ends_in_reasoning(off)
    no_gen = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen.ends_in_reasoning is False
    assert prompt_ends_in_reasoning("<|assistant|><think>\n")
    assert not prompt_ends_in_reasoning("<|assistant|><think>x</think>")


def test_raise_exception_becomes_template_error(template):
    with pytest.raises(TemplateError, match="unsupported chat role: narrator"):
        template.render([{"role": "narrator", "content": "Once upon a time"}])


def test_bad_tool_arguments_are_template_errors(template):
    with pytest.raises(TemplateError, match="not valid JSON"):
        template.render([{"role": "user", "content": "Q"}, _assistant_call("{city: Bern")])
    with pytest.raises(TemplateError, match="must be a mapping"):
        # A JSON string that decodes to a string is still a string: the template refuses it.
        template.render([{"role": "user", "content": "Q"}, _assistant_call('"just text"')])


def test_image_parts_render_as_glm_image_placeholders(template):
    parts = [{"type": "text", "text": "Compare "},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             {"type": "text", "text": " and "},
             {"type": "image_url", "image_url": {"url": "https://example.com/b.png", "detail": "high"}}]
    image = "<|begin_of_image|><|image|><|end_of_image|>"
    prompt = template.render([{"role": "user", "content": parts}])
    assert prompt == f"[gMASK]<sop><|user|>Compare {image} and {image}<|assistant|><think>"
    # What the template sees: the same parts, each image as {"type": "image"} (its URL is not the template's)
    seen = normalize_messages([{"role": "user", "content": parts}])
    assert seen[0]["content"][1] == {"type": "image"} and template.render(seen) == prompt


def test_non_text_content_part_rejected(template):
    with pytest.raises(TemplateError, match="input_audio"):
        template.render([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}])


def test_reserved_kwargs_rejected(template):
    with pytest.raises(TemplateError, match="messages"):
        template.render([{"role": "user", "content": "Hi"}], messages=[])
    with pytest.raises(TemplateError, match="documents"):
        template.render([{"role": "user", "content": "Hi"}], **{"documents": ["d"]})


def test_undefined_method_is_template_error(tmp_path):
    bad = ChatTemplate("{{ messages[0].content.nonexistent() }}")
    with pytest.raises(TemplateError):
        bad.render([{"role": "user", "content": "Hi"}])


def test_normalize_messages():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"], "name": None},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}], "thinking": "t"},
    ]
    out = normalize_messages(messages)
    assert out[0] == {"role": "user", "content": "ab"}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[1]["reasoning_content"] == "t" and out[1]["thinking"] == "t"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    with_image = [{"role": "user", "content": ["a", {"type": "image_url", "image_url": {"url": "data:,"}}, "b"]}]
    assert normalize_messages(with_image)[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]


def test_jinja_file_takes_precedence(tmp_path):
    write_tokenizer(tmp_path)
    custom = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}|{% endif %}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}!{% endif %}"
    )
    (tmp_path / "chat_template.jinja").write_text(custom, encoding="utf-8")
    ours = ChatTemplate.from_dir(tmp_path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    rendered = ours.render(messages)
    assert rendered == "<system>S|<user>U<|endoftext|>!"  # trim_blocks eats the newlines
    assert rendered == _oracle(oracle, messages)
    assert ours.source == custom


def test_named_templates_select_tool_use(tmp_path):
    write_tokenizer(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "DEFAULT{% for m in messages %} {{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}{% for t in tools %} {{ t.function.name }}{% endfor %}"},
    ]
    config_path.write_text(json.dumps(config))
    ours = ChatTemplate.from_dir(tmp_path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.render(messages) == _oracle(oracle, messages) == "DEFAULT hi"
    assert ours.render(messages, tools=TOOLS) == _oracle(oracle, messages, tools=TOOLS) == "TOOLS 2 get_weather search"
    assert ours.template_name(None) == "default" and ours.template_name([]) == "tool_use"


def test_environment_features_match_transformers(tmp_path):
    write_tokenizer(tmp_path)
    custom = (
        "{{ tools | tojson }}\n"
        "{{ tools[0] | tojson(indent=2, sort_keys=True) }}\n"
        "{{ {'b': 1, 'a': 'é'} | tojson(separators=(',', ':'), ensure_ascii=True) }}\n"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}"
        "{% endif %}[{{ m.content }}]{% endfor %}\n"
        "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}{% endfor %}"
        "{{ ns.count }} {{ dict(x=1) | tojson }} {{ pad_token }} {{ bos_token is defined }} {{ documents }}\n"
        "{%- if enable_thinking is defined %} think={{ enable_thinking }}{% endif %}\n"
        "  {% if add_generation_prompt %}\n  GEN\n  {% endif %}\n"
    )
    (tmp_path / "chat_template.jinja").write_text(custom, encoding="utf-8")
    ours = ChatTemplate.from_dir(tmp_path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "user", "content": "u2"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        assert ours.render(messages, tools=TOOLS, **kwargs) == _oracle(oracle, messages, tools=TOOLS, **kwargs)


def test_strftime_now(tmp_path):
    t = ChatTemplate("{{ strftime_now('%Y') }}")
    assert t.render([{"role": "user", "content": "x"}]) == str(datetime.datetime.now().year)


def test_sandbox_blocks_unsafe_access():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{% set ns = namespace(_x=1) %}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_missing_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        ChatTemplate.from_dir(tmp_path)


def test_syntax_error_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
