"""Tests for the tiny glm5_next model's tokenizer (engine/tiny/tokenizer.py).

transformers' ``AutoTokenizer`` / ``apply_chat_template`` is the oracle: the
directory written by ``write_tokenizer`` must load there, tokenize exactly like
the raw ``tokenizers`` file, and render the GLM-4.7/GLM-5 prompt format.  The
expected prompts are spelled out literally so any template change shows up.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import transformers
from tokenizers import Tokenizer

from engine.tiny.tokenizer import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    MODEL_MAX_LENGTH,
    TOKEN_IDS,
    TinyTokenizerInfo,
    write_tokenizer,
)

EXPECTED_IDS = {
    "<|endoftext|>": 256,
    "[MASK]": 257,
    "[gMASK]": 258,
    "[sMASK]": 259,
    "<sop>": 260,
    "<eop>": 261,
    "<|system|>": 262,
    "<|user|>": 263,
    "<|assistant|>": 264,
    "<|observation|>": 265,
    "<|begin_of_image|>": 266,
    "<|end_of_image|>": 267,
    "<|begin_of_video|>": 268,
    "<|end_of_video|>": 269,
    "<|image|>": 270,
    "<|video|>": 271,
    "<think>": 272,
    "</think>": 273,
    "<tool_call>": 274,
    "</tool_call>": 275,
    "<tool_response>": 276,
    "</tool_response>": 277,
    "<arg_key>": 278,
    "</arg_key>": 279,
    "<arg_value>": 280,
    "</arg_value>": 281,
    "/nothink": 282,
}
# Added but not special, as in GLM's tokenizer: kept by skip_special_tokens=True,
# so reasoning / tool-call parsers see them in decoded text.
NON_SPECIAL = {
    "<|image|>", "<|video|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "/nothink",
}

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "café déjà vu é",
    "中文分词测试",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇳🇴",
    "mixed: naïve 中文 🚀 \x00\x7f end",
    "",
]

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

TOOLS_PREAMBLE = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}\n'
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo and Paris?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "\nI should call the weather tool twice.\n",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Paris", "units": ["C", "F"], "detail": {"wind": True}, "note": None},
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3, "sky": "snow"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12°C, sunny"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny_tok")


@pytest.fixture(scope="module")
def info(tok_dir) -> TinyTokenizerInfo:
    return write_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def raw(tok_dir, info) -> Tokenizer:
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf(tok_dir, info):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def render(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


# --- files, ids, info -------------------------------------------------------


def test_info_and_id_table(info, raw):
    assert info == TinyTokenizerInfo(vocab_size=283, eos_token_ids=[256, 263, 265], pad_token_id=256)
    assert TOKEN_IDS == EXPECTED_IDS
    assert raw.get_vocab_size(with_added_tokens=True) == 283
    for content, tid in EXPECTED_IDS.items():
        assert raw.token_to_id(content) == tid
        assert raw.id_to_token(tid) == content


def test_added_token_special_flags(raw):
    flags = {t.content: t.special for t in raw.get_added_tokens_decoder().values()}
    assert flags == {c: c not in NON_SPECIAL for c in EXPECTED_IDS}
    assert [(c, s) for c, s in ADDED_TOKENS] == [(c, c not in NON_SPECIAL) for c in EXPECTED_IDS]


def test_tokenizer_config(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == "<|endoftext|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    assert cfg["model_max_length"] == MODEL_MAX_LENGTH
    assert cfg["padding_side"] == "left"
    assert cfg["clean_up_tokenization_spaces"] is False
    assert cfg["do_lower_case"] is False
    assert cfg["chat_template"] == CHAT_TEMPLATE
    decoder = cfg["added_tokens_decoder"]
    assert {int(k): v["content"] for k, v in decoder.items()} == {v: k for k, v in EXPECTED_IDS.items()}
    assert all(v["special"] == (v["content"] not in NON_SPECIAL) for v in decoder.values())


def test_write_is_deterministic(tmp_path, tok_dir, info):
    assert write_tokenizer(tmp_path / "again" / "nested") == info
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / "nested" / name).read_bytes() == (tok_dir / name).read_bytes()


# --- byte-level encode / decode ---------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_per_byte(raw, text):
    ids = raw.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert raw.decode(ids) == text
    assert raw.decode(ids, skip_special_tokens=False) == text


def test_token_by_token_bytes_reassemble(raw):
    # A caller that decodes incrementally sees partial UTF-8 sequences; since each
    # token is exactly one byte, buffering bytes and decoding when complete works.
    text = "é中😀"
    ids = raw.encode(text).ids
    assert len(ids) == 2 + 3 + 4
    assert "\ufffd" in raw.decode(ids[:1])  # a lone lead byte is not text yet
    assert bytes(ids).decode("utf-8") == text
    pieces, pending = [], []
    for tid in ids:
        pending.append(tid)
        piece = raw.decode(pending)
        if not piece.endswith("\ufffd"):
            pieces.append(piece)
            pending = []
    assert pieces == ["é", "中", "😀"] and not pending


@pytest.mark.parametrize("content", list(EXPECTED_IDS))
def test_added_tokens_are_single_tokens_in_text(raw, content):
    text = f"a{content}b"
    ids = raw.encode(text).ids
    assert ids == [ord("a"), EXPECTED_IDS[content], ord("b")]
    assert raw.decode(ids, skip_special_tokens=False) == text
    expected_skipped = text if content in NON_SPECIAL else "ab"
    assert raw.decode(ids, skip_special_tokens=True) == expected_skipped


def test_no_bos_or_eos_added(raw):
    assert raw.encode("hi", add_special_tokens=True).ids == [ord("h"), ord("i")]


# --- transformers ------------------------------------------------------------


def test_autotokenizer_matches_raw(hf, raw):
    assert len(hf) == 283
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 256
    assert hf.pad_token == "<|endoftext|>" and hf.pad_token_id == 256
    assert hf.padding_side == "left"
    assert hf.model_max_length == MODEL_MAX_LENGTH
    samples = TEXTS + [
        "[gMASK]<sop><|system|>sys<|user|>hi 😀<|assistant|><think>hmm</think>ok",
        "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call><|observation|>/nothink",
    ]
    for text in samples:
        ids = raw.encode(text).ids
        assert hf.encode(text, add_special_tokens=True) == ids
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids, skip_special_tokens=False) == raw.decode(ids, skip_special_tokens=False) == text
        assert hf.decode(ids, skip_special_tokens=True) == raw.decode(ids, skip_special_tokens=True)
    for content, tid in EXPECTED_IDS.items():
        assert hf.convert_tokens_to_ids(content) == tid


# --- chat template (transformers apply_chat_template is the oracle) ---------


def test_chat_system_user_generation_prompt(hf):
    assert render(hf, SYSTEM_USER, add_generation_prompt=True) == (
        "[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello!<|assistant|><think>"
    )


def test_chat_thinking_disabled(hf):
    assert render(hf, SYSTEM_USER, add_generation_prompt=True, enable_thinking=False) == (
        "[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello!<|assistant|></think>"
    )
    assert render(hf, SYSTEM_USER, add_generation_prompt=True, enable_thinking=True) == (
        "[gMASK]<sop><|system|>You are a helpful assistant.<|user|>Hello!<|assistant|><think>"
    )


def test_chat_no_generation_prompt_and_raw_user_text(hf):
    messages = [{"role": "user", "content": "  keep my spacing \n"}]
    assert render(hf, messages) == "[gMASK]<sop><|user|>  keep my spacing \n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]}]
    assert render(hf, parts) == "[gMASK]<sop><|user|>one two"


def test_chat_history_reasoning_is_cleared(hf):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    assert render(hf, messages) == (
        "[gMASK]<sop><|user|>2+2?<|assistant|></think>4"
        "<|user|>And 3+3?<|assistant|><think>Add again.</think>6"
    )
    assert render(hf, messages, clear_thinking=False) == (
        "[gMASK]<sop><|user|>2+2?<|assistant|><think>Add them.</think>4"
        "<|user|>And 3+3?<|assistant|><think>Add again.</think>6"
    )
    assert render(hf, messages[:3], add_generation_prompt=True) == (
        "[gMASK]<sop><|user|>2+2?<|assistant|></think>4<|user|>And 3+3?<|assistant|><think>"
    )


def test_chat_assistant_reasoning_and_tool_calls_then_tool_results(hf):
    assert render(hf, TOOL_CONVERSATION, add_generation_prompt=True) == (
        "[gMASK]<sop><|user|>Weather in Oslo and Paris?"
        "<|assistant|><think>I should call the weather tool twice.</think>Checking both."
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        '<arg_key>units</arg_key><arg_value>["C", "F"]</arg_value>'
        '<arg_key>detail</arg_key><arg_value>{"wind": true}</arg_value>'
        "<arg_key>note</arg_key><arg_value>null</arg_value></tool_call>"
        '<|observation|><tool_response>{"temp": -3, "sky": "snow"}</tool_response>'
        "<tool_response>12°C, sunny</tool_response>"
        "<|assistant|><think>"
    )


def test_chat_tool_result_message(hf):
    messages = [
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "run", "arguments": {}}}]},
        {"role": "tool", "content": "done"},
        {"role": "user", "content": "Thanks"},
        {"role": "tool", "content": [{"type": "text", "text": "late"}]},
    ]
    assert render(hf, messages) == (
        "[gMASK]<sop><|user|>Run it.<|assistant|></think><tool_call>run</tool_call>"
        "<|observation|><tool_response>done</tool_response>"
        "<|user|>Thanks<|observation|><tool_response>late</tool_response>"
    )


def test_chat_tools_listed(hf):
    assert render(hf, SYSTEM_USER, tools=[WEATHER_TOOL], add_generation_prompt=True) == (
        "[gMASK]<sop>" + TOOLS_PREAMBLE + "<|system|>You are a helpful assistant.<|user|>Hello!<|assistant|><think>"
    )
    full = (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
        '"required": ["city"]}}}\n'
        '{"type": "function", "function": {"name": "ping", "description": "Ünïcödé stays as is"}}\n'
        "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
        "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
        "<|user|>hi<|assistant|></think>"
    )
    ping = {"type": "function", "function": {"name": "ping", "description": "Ünïcödé stays as is"}}
    rendered = render(
        hf, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL, ping],
        add_generation_prompt=True, enable_thinking=False,
    )
    assert rendered == full


def test_chat_rejects_string_arguments_and_unknown_roles(hf):
    bad_args = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]
    with pytest.raises(Exception, match="must be a mapping"):
        render(hf, bad_args)
    with pytest.raises(Exception, match="unsupported chat role: narrator"):
        render(hf, [{"role": "narrator", "content": "x"}])


def test_rendered_prompt_tokenizes_specials_as_single_ids(hf, raw):
    prompt = render(hf, TOOL_CONVERSATION, add_generation_prompt=True)
    ids = raw.encode(prompt).ids
    assert ids[:3] == [258, 260, 263]  # [gMASK] <sop> <|user|>
    assert ids[-2:] == [264, 272]  # <|assistant|> <think>
    for marker in ("<|assistant|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                   "</arg_key>", "<arg_value>", "</arg_value>", "<|observation|>", "<tool_response>",
                   "</tool_response>"):
        assert ids.count(EXPECTED_IDS[marker]) == prompt.count(marker), marker
    assert raw.decode(ids, skip_special_tokens=False) == prompt
