"""Tokenizer for the tiny embedded glm5_next model (random weights, CPU-sized).

The tiny model exists so newcomers and tests can exercise the whole serving path
(tokenize -> chat template -> prefill/decode -> detokenize -> tool/reasoning
parsing) without the real checkpoint.  Its tokenizer therefore has to look like
GLM's from the outside while staying trivially small:

* Byte level: token id ``b`` *is* the UTF-8 byte ``b`` (ids 0..255), using the
  GPT-2 style ByteLevel byte<->unicode mapping, a BPE model with no merges, and
  the ByteLevel decoder.  Any text round-trips exactly; a multi-byte character
  spans several tokens, so token-by-token detokenization must buffer incomplete
  UTF-8 sequences (the caller's job, exactly as with the real tokenizer).
* GLM's role/control tokens follow as added tokens with ids from 256 on, in the
  order of ``ADDED_TOKENS`` below.  ``special`` mirrors the released GLM-4.5 ..
  GLM-5 tokenizers: role/control markers are special (dropped by
  ``skip_special_tokens``), while ``<think>``, the tool-call tags, ``/nothink``
  and the ``<|image|>``/``<|video|>`` placeholders are added but *not* special,
  so reasoning and tool-call parsers still see them in decoded text.
  GLM's no-think switch is the literal added token ``/nothink`` (there is no
  ``<|nothink|>`` token in GLM's vocabulary); the template never emits it.

Special-token ids::

    256 <|endoftext|>      special  eos, pad, stop
    257 [MASK]             special
    258 [gMASK]            special  prompt prefix
    259 [sMASK]            special
    260 <sop>              special  prompt prefix
    261 <eop>              special
    262 <|system|>         special
    263 <|user|>           special  stop
    264 <|assistant|>      special
    265 <|observation|>    special  stop
    266 <|begin_of_image|> special
    267 <|end_of_image|>   special
    268 <|begin_of_video|> special
    269 <|end_of_video|>   special
    270 <|image|>          added (not special, as in GLM)
    271 <|video|>          added (not special, as in GLM)
    272 <think>            added
    273 </think>           added
    274 <tool_call>        added
    275 </tool_call>       added
    276 <tool_response>    added
    277 </tool_response>   added
    278 <arg_key>          added
    279 </arg_key>         added
    280 <arg_value>        added
    281 </arg_value>       added
    282 /nothink           added

``vocab_size`` is 283; the model's embedding may be padded larger.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "MODEL_MAX_LENGTH",
    "NUM_BYTE_TOKENS",
    "TOKEN_IDS",
    "TinyTokenizerInfo",
    "build_tokenizer",
    "write_tokenizer",
]

NUM_BYTE_TOKENS = 256

# (content, special) in id order, starting at NUM_BYTE_TOKENS.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<|begin_of_image|>", True),
    ("<|end_of_image|>", True),
    ("<|begin_of_video|>", True),
    ("<|end_of_video|>", True),
    ("<|image|>", False),
    ("<|video|>", False),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", False),
)

TOKEN_IDS: dict[str, int] = {
    content: NUM_BYTE_TOKENS + i for i, (content, _special) in enumerate(ADDED_TOKENS)
}

# GLM-5's context length; only used as tokenizer metadata.
MODEL_MAX_LENGTH = 202752

_EOS = "<|endoftext|>"
_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


# ---------------------------------------------------------------------------
# Chat template
# ---------------------------------------------------------------------------
# Written for glmflash; it renders the prompt format of the released
# GLM-4.7 / GLM-5 templates:
#
#   [gMASK]<sop>
#   [<|system|>\n# Tools ... <tools>\n{tool json}\n...</tools> ... format line]   (only with tools)
#   <|system|>{text}   <|user|>{text}                     (no newline after the role marker)
#   <|assistant|><think>{reasoning}</think>{content}<tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value>...</tool_call>
#   <|observation|><tool_response>{result}</tool_response>[<tool_response>...]   (one marker per run of tool messages)
#
# Choices, with the version they follow:
# * Generation prompt (GLM-4.7/GLM-5): ``<|assistant|><think>`` by default and
#   ``<|assistant|></think>`` when ``enable_thinking`` is passed and false.
#   GLM-4.5/4.6 instead emitted a bare ``<|assistant|>`` (thinking on) or
#   ``<|assistant|>\n<think></think>`` plus ``/nothink`` appended to user turns
#   (thinking off), and put ``\n`` after every role marker; none of that is
#   done here ("/nothink-free").
# * Reasoning (GLM-4.7/GLM-5): an assistant turn after the last user message
#   keeps ``<think>{reasoning_content.strip()}</think>``; earlier turns, and
#   turns with empty reasoning, get a bare ``</think>`` (GLM-4.7/5's history
#   form, not GLM-4.5's ``\n<think></think>``).  As in GLM, a non-empty but
#   all-whitespace ``reasoning_content`` still counts and renders as
#   ``<think></think>``.  Passing ``clear_thinking=False``
#   keeps reasoning on every turn, as GLM-4.7's template allows.  Reasoning is
#   taken from ``reasoning_content`` or, failing that, split off a
#   ``...</think>`` prefix of ``content``.
# * Tool-call arguments must be a mapping (as vLLM/SGLang pass them after
#   json-decoding the OpenAI ``arguments`` string); string values are written
#   raw, other values as JSON.  A JSON *string* of arguments is rejected.
# * Tools are listed one ``tojson`` line each, exactly as given (GLM-4.7/5
#   dump the OpenAI ``{"type": "function", "function": {...}}`` object as is).
# * ``content: None`` renders as nothing (GLM-4.7 printed the word ``None``;
#   later GLM-5 templates fixed that).
# * ``developer`` messages render like ``system``; ``tool`` and
#   ``observation`` are both tool results; any other role is an error.
# * Images (GLM-4.xV): an ``{"type": "image"}`` part of a system or user
#   message renders as ``<|begin_of_image|><|image|><|end_of_image|>``, one
#   ``<|image|>`` per image, which the server expands to the image's run of
#   image tokens; image parts elsewhere are dropped.
#
# All literal output is inside ``{{ }}`` and every tag trims whitespace, so the
# rendering does not depend on trim_blocks/lstrip_blocks.  It does rely on the
# transformers chat-template environment: ``tojson(ensure_ascii=False)`` as
# json.dumps and ``raise_exception``.
CHAT_TEMPLATE = r"""{#- glmflash tiny model: GLM-4.7 / GLM-5 prompt format (see engine/tiny/tokenizer.py) -#}
{%- macro plain_text(value, images=false) -%}
    {%- if value is none -%}
    {%- elif value is string -%}{{- value -}}
    {%- elif value is mapping -%}{{- value.text if value.text is string else '' -}}
    {%- elif value is iterable -%}
        {%- for part in value -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
            {%- elif images and part is mapping and part.type == 'image' -%}{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}{{- value -}}
    {%- endif -%}
{%- endmacro -%}
{%- set keep_old_reasoning = clear_thinking is defined and not clear_thinking -%}
{%- set state = namespace(final_user=-1) -%}
{%- for msg in messages -%}
    {%- if msg.role == 'user' -%}{%- set state.final_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
    {%- for spec in tools -%}{{- spec | tojson(ensure_ascii=False) -}}{{- '\n' -}}{%- endfor -%}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n' -}}
    {{- '<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>' -}}
    {{- '<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- for msg in messages -%}
    {%- if msg.role in ['system', 'developer'] -%}
        {{- '<|system|>' ~ plain_text(msg.content, true) -}}
    {%- elif msg.role == 'user' -%}
        {{- '<|user|>' ~ plain_text(msg.content, true) -}}
    {%- elif msg.role == 'assistant' -%}
        {%- set answer = plain_text(msg.content) -%}
        {%- set thought = '' -%}
        {%- if msg.reasoning_content is string -%}
            {%- set thought = msg.reasoning_content -%}
        {%- elif '</think>' in answer -%}
            {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- set answer = answer.split('</think>')[-1] -%}
        {%- endif -%}
        {{- '<|assistant|>' -}}
        {%- if thought and (keep_old_reasoning or loop.index0 > state.final_user) -%}
            {{- '<think>' ~ thought.strip() ~ '</think>' -}}
        {%- else -%}
            {{- '</think>' -}}
        {%- endif -%}
        {{- answer.strip() -}}
        {%- for call in msg.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if fn.arguments is string -%}
                {{- raise_exception('tool_calls[].function.arguments must be a mapping, not a JSON string; decode it before rendering') -}}
            {%- endif -%}
            {{- '<tool_call>' ~ fn.name -}}
            {%- for key, value in (fn.arguments or {}).items() -%}
                {{- '<arg_key>' ~ key ~ '</arg_key><arg_value>' -}}
                {%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson(ensure_ascii=False) -}}{%- endif -%}
                {{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif msg.role in ['tool', 'observation'] -%}
        {%- if loop.first or messages[loop.index0 - 1].role not in ['tool', 'observation'] -%}
            {{- '<|observation|>' -}}
        {%- endif -%}
        {{- '<tool_response>' ~ plain_text(msg.content) ~ '</tool_response>' -}}
    {%- else -%}
        {{- raise_exception('unsupported chat role: ' ~ msg.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}{{- '</think>' -}}{%- else -%}{{- '<think>' -}}{%- endif -%}
{%- endif -%}
"""


@dataclass(frozen=True)
class TinyTokenizerInfo:
    vocab_size: int  # number of tokens the tokenizer defines (the model's vocab_size may be padded larger)
    eos_token_ids: list[int]  # <|endoftext|>, <|user|>, <|observation|> (in that order)
    pad_token_id: int  # <|endoftext|>


def _byte_vocab() -> dict[str, int]:
    """ByteLevel's printable stand-in for every byte, mapped to id == byte value."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Reconstruct GPT-2's bytes_to_unicode order so that id == byte value.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    vocab = {mapping[b]: b for b in range(NUM_BYTE_TOKENS)}
    if set(vocab) != set(alphabet):  # guard against a tokenizers change of mapping
        raise RuntimeError("ByteLevel alphabet does not match the GPT-2 byte mapping")
    return vocab


def build_tokenizer() -> Tokenizer:
    """The tiny byte-level tokenizer (in memory)."""
    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[], fuse_unk=False, byte_fallback=False))
    # use_regex=False: with no merges the GPT-2 split regex would change nothing.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for content, special in ADDED_TOKENS
    ]
    # add_tokens keeps each token's own `special` flag; ids are assigned in order.
    tok.add_tokens(added)
    for content, _ in ADDED_TOKENS:
        if tok.token_to_id(content) != TOKEN_IDS[content]:
            raise RuntimeError(f"added token {content!r} got id {tok.token_to_id(content)}")
    return tok


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": _EOS,
        "pad_token": _EOS,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "added_tokens_decoder": {
            str(TOKEN_IDS[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: pathlib.Path) -> TinyTokenizerInfo:
    """Writes tokenizer.json and tokenizer_config.json (with chat_template) into out_dir."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return TinyTokenizerInfo(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token_ids=[TOKEN_IDS[t] for t in _STOP_TOKENS],
        pad_token_id=TOKEN_IDS[_EOS],
    )
