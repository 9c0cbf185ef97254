"""Turn GLM tool-call markup into OpenAI ``tool_calls``, whole or streamed.

GLM-4.5/4.6 write one call as::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

and GLM-4.7/5 write the same without the newlines.  GLM-5.3-Flash mostly writes
the JSON form that SGLang's ``glm53_flash`` detector documents::

    <tool_call>get_weather>{"city": "Beijing"}

the name ended by ``>`` and the arguments one JSON object, with no closing tag
(a ``</tool_call>`` after it is dropped).  Both forms may appear in one output;
several calls may follow each other and ordinary content may come first.  All
six tags are non-special added tokens, so they reach us as literal text,
possibly split across deltas.  The JSON form is also what the server forces for
``tool_choice`` "required" or a named function (``worker/structured.py``).

In the tag form, arguments become a JSON object text built pair by pair; a value is kept as the
raw string when the tool's JSON schema says the parameter is a string (also
``["string", "null"]`` and ``anyOf``/``oneOf`` of string and null, which is how
pydantic writes ``Optional[str]``), so ``"01234"`` stays ``"01234"``.  Any other
value -- typed non-string, a parameter or tool missing from the schema, or no
tools at all -- is parsed with ``json.loads`` and, failing that,
``ast.literal_eval`` (``True``, ``{'a': 1}``), keeping the stripped string if
neither gives a JSON value.  That is the order vLLM's ``glm4_moe_tool_parser``
(``_deserialize``) and SGLang's ``glm47_moe_detector`` (``parse_arguments``) use.

JSON-form arguments are streamed as they are generated, character for
character (SGLang sends them only once the object is complete); the object's
end is found by counting braces and brackets outside strings.  Before the
object only whitespace may come: anything else leaves the call with ``{}``
and is read as content.  A name with namespaces (``Weather/get_weather``) one
of whose parts is a given tool becomes that tool (SGLang; its fuzzier matches,
case or substrings, are not done).

Streaming emits the tool name once it is complete (at ``<arg_key>``,
``</tool_call>`` or the JSON form's ``>``), then argument text as it becomes final: a string value is
streamed while it is generated (escaped, with the partial ``</arg_value>`` held
back; long file contents would otherwise arrive in one piece, vLLM issue
#32829); other values when their ``</arg_value>`` arrives; the closing ``}`` at
``</tool_call>``.  The fragments of one call always concatenate to its final
arguments, and :meth:`GlmToolParser.extract` runs the same machine over the
whole text, so streamed and non-streamed results are identical.

Malformed output, following vLLM's ``glm4_moe_tool_parser.py``/``glm47`` and
SGLang's ``glm47_moe_detector.py`` where they agree and noted where not:

* unknown tool names are passed through unchanged (vLLM; SGLang drops them
  unless ``SGLANG_FORWARD_UNKNOWN_TOOLS``); the client decides what to tell the
  model;
* the name is the text before the first tag, first line only (GLM-4.5's
  newline; SGLang also ends it at a literal ``\\n``), stripped; so a stray tag
  such as ``<tool_call>f</arg_value></tool_call>`` gives ``f``, not
  ``f</arg_value>`` (a ``>`` after a ``<`` in the name closes such a tag, not
  the name).  A call with an empty name is dropped (SGLang);
* a zero-argument call ``<tool_call>f</tool_call>`` has arguments ``{}`` also
  when streamed (vLLM's streaming parser used to drop it, vLLM issue #44326);
* a key not followed by ``<arg_value>`` before the next ``<arg_key>`` or
  ``</tool_call>`` is dropped; any text between pairs is ignored (both accept
  whitespace and a literal ``\\n`` there);
* ``</tool_call>`` inside an open key or value ends the call; an open value is
  kept with what it has (vLLM's streaming path "treat partial as complete
  value"); a repeated key is written twice, so a JSON reader keeps the last one,
  as vLLM's and SGLang's dicts do;
* a ``<tool_call>`` right after a complete pair starts a new call: the previous
  one only lacked its ``</tool_call>``; in the JSON form, a tool-call tag outside
  a string ends unfinished arguments where they stand;
* content is the text outside calls, joined verbatim (vLLM's streaming parser
  and SGLang's detectors keep text between and after calls too), except that
  whitespace separating it from a call at its start or end is dropped, so
  ``"Sure.\\n<tool_call>..."`` gives ``"Sure."`` and whitespace-only text gives
  no content; a stray ``</tool_call>`` outside a call is dropped (SGLang).

End of output inside a call (``max_tokens``, or a model that omits the closing
tag): a call that ended between argument pairs is closed, since only
``</tool_call>`` is missing.  Otherwise what was streamed stays as it is: a call
whose name never completed produces nothing, and a call cut inside a key or a
value keeps its arguments text unterminated.  That is what vLLM's and SGLang's
streaming parsers leave behind and what OpenAI returns with
``finish_reason="length"``; their non-streaming paths instead return such text
as content, which we do not, so that streaming and non-streaming agree and no
markup reaches content.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_START = "<tool_call>"
NAME_END = ">"  # GLM-5.3-Flash's JSON form: <tool_call>name>{arguments}
TOOL_CALL_END = "</tool_call>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"
_ALL_TAGS = (TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END)
_NAME_LINE_END = re.compile(r"\n|\\n")


@dataclass(frozen=True)
class ToolCall:
    """A complete call, the OpenAI ``tool_calls[]`` item flattened: ``function`` holds ``name`` and ``arguments``."""

    id: str
    name: str
    arguments: str  # JSON object text
    type: Literal["function"] = "function"


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: the first piece carries ``id``, ``type`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    type: Literal["function"] | None = None
    name: str | None = None


@dataclass
class ToolStreamDelta:
    """What one :meth:`GlmToolParser.feed` adds: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _State(enum.Enum):
    CONTENT = enum.auto()
    NAME = enum.auto()
    KEY = enum.auto()
    AWAIT_VALUE = enum.auto()  # after </arg_key>, before <arg_value>
    VALUE = enum.auto()
    BETWEEN = enum.auto()  # after a complete pair
    DISCARD = enum.auto()  # inside a call with an empty name
    JSON = enum.auto()  # GLM-5.3-Flash's form: the arguments object after `name>`


# The tags each state reacts to; any other text is that state's data.
_TAGS: dict[_State, tuple[str, ...]] = {
    _State.CONTENT: (TOOL_CALL_START, TOOL_CALL_END),
    _State.NAME: (ARG_KEY_START, TOOL_CALL_END, NAME_END),
    _State.KEY: (ARG_KEY_END, TOOL_CALL_END),
    _State.AWAIT_VALUE: (ARG_VALUE_START, ARG_KEY_START, TOOL_CALL_END),
    _State.VALUE: (ARG_VALUE_END, TOOL_CALL_END),
    _State.BETWEEN: (ARG_KEY_START, TOOL_CALL_END, TOOL_CALL_START),
    _State.DISCARD: (TOOL_CALL_END,),
}


def _is_string_schema(schema: Any) -> bool:
    """Whether a parameter schema only admits strings (null aside)."""
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind == "string"
    if isinstance(kind, list):
        return [k for k in kind if k != "null"] == ["string"]
    for keyword in ("anyOf", "oneOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            non_null = [b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")]
            return bool(non_null) and all(_is_string_schema(b) for b in non_null)
    return False


def _string_params(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, frozenset[str]]:
    """Tool name -> names of its string-typed parameters."""
    table: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        table[function.get("name", "")] = frozenset(k for k, v in properties.items() if _is_string_schema(v))
    return table


def _json_value(raw: str) -> str:
    """JSON text for a value that is not string-typed: parsed if possible, else the stripped string."""
    text = raw.strip()
    try:
        value: Any = json.loads(text)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            value = text
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, NaN...: not JSON
        return json.dumps(text, ensure_ascii=False)


def _clean_name(raw: str) -> str:
    """The function name: text before any stray tag, first line, stripped."""
    for tag in _ALL_TAGS:
        raw = raw.split(tag, 1)[0]
    return _NAME_LINE_END.split(raw.strip(), maxsplit=1)[0].strip()


def _find_tag(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str | None]:
    """Position and value of the earliest of ``tags`` in ``text[start:]``; ``(-1, None)`` when none."""
    best, found = -1, None
    for tag in tags:
        pos = text.find(tag, start)
        if pos != -1 and (best == -1 or pos < best):
            best, found = pos, tag
    return best, found


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into one of ``tags``.

    Every tag starts with ``<``, so only suffixes starting there are tried.
    """
    pos = text.find("<", max(0, len(text) - max(map(len, tags)) + 1))
    while pos != -1:
        if any(tag.startswith(text[pos:]) for tag in tags):
            return len(text) - pos
        pos = text.find("<", pos + 1)
    return 0


class GlmToolParser:
    """One request's tool-call parser: stream with :meth:`feed`/:meth:`finish`, or :meth:`extract`.

    ``tools`` is the request's OpenAI ``tools`` list as plain dicts (e.g.
    ``[t.model_dump() for t in request.tools]``); it only serves to type the
    argument values.  Feed the content left after reasoning has been split off.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self._tools = tools
        self._string_params = _string_params(tools)
        self._json_depth = 0  # JSON form: open objects and arrays of the arguments
        self._json_string = self._json_escape = False  # JSON form: inside a string, after a backslash
        self._emit_json = True  # JSON form: False while skipping the arguments of a call with no name
        self._state = _State.CONTENT
        self._buf = ""  # unconsumed text: at most a partial tag
        self._held_ws = ""  # trailing content whitespace: dropped if only calls follow
        self._started = False  # some content was emitted
        self._call_after_content = False  # a call came after the last emitted content
        self._skip_ws = False  # a call came before any content: leading whitespace is a separator
        self._index = -1  # index of the current (or last) announced call
        self._name = ""
        self._parts: list[str] = []  # raw text of the current name, key or non-string value
        self._key = ""
        self._string_value = False
        self._pairs = 0  # argument pairs written for the current call
        self._out = ToolStreamDelta()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Non-streaming parse of a whole output into ``(content, tool_calls)``; ``None`` for no content."""
        stream = GlmToolParser(self._tools)
        content = ""
        calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        for delta in (stream.feed(text), stream.finish()):
            content += delta.content
            for piece in delta.tool_calls:
                if piece.id is not None:
                    calls[piece.index] = [piece.id, piece.name or "", ""]
                calls[piece.index][2] += piece.arguments
        return content or None, [ToolCall(id=i, name=n, arguments=a) for i, n, a in calls.values()]

    def feed(self, delta: str) -> ToolStreamDelta:
        """Parse a streamed text delta; text that may still be part of a tag is held back."""
        self._out = ToolStreamDelta()
        text, start = self._buf + delta, 0  # scan by offset: a whole output may hold many tags
        while True:
            if self._state is _State.JSON:
                start = self._scan_json(text, start)
                if self._state is _State.JSON:  # all consumed, or a partial tag held
                    self._buf = text[start:]
                    return self._out
                continue
            tags = _TAGS[self._state]
            pos, tag = _find_tag(text, tags, start)
            if tag is None:
                end = len(text) - _partial_tag_len(text[start:], tags)
                self._on_text(text[start:end])
                self._buf = text[end:]
                return self._out
            self._on_text(text[start:pos])
            start = pos + len(tag)
            self._on_tag(tag)

    def finish(self) -> ToolStreamDelta:
        """End of output: flush held content and close a call that only lacks ``</tool_call>``."""
        self._out = ToolStreamDelta()
        if self._state is _State.CONTENT:
            held = "" if self._call_after_content and not self._buf else self._held_ws
            self._out.content = held + self._buf
        elif self._state is _State.BETWEEN:
            self._close_call()
        elif self._state is _State.JSON and self._emit_json:  # cut: what was generated stays as it is
            rest = self._buf if self._json_depth else "{}"
            if rest:
                self._arguments(rest)
        self._buf = self._held_ws = ""
        return self._out

    # -- state machine -------------------------------------------------------

    def _on_text(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state is _State.CONTENT:
            self._content(text)
        elif state in (_State.NAME, _State.KEY) or (state is _State.VALUE and not self._string_value):
            self._parts.append(text)
        elif state is _State.VALUE:
            self._arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        # AWAIT_VALUE, BETWEEN, DISCARD: text between tags is ignored

    def _on_tag(self, tag: str) -> None:
        state = self._state
        if state is _State.CONTENT:
            if tag == TOOL_CALL_START:
                self._start_call()
            # a stray </tool_call> in content is dropped
        elif state is _State.NAME:
            if tag == NAME_END and "<" in "".join(self._parts):
                self._parts.append(tag)  # the end of a stray tag after the name, not the name's end
                return
            self._name = self._resolve_name(_clean_name("".join(self._parts)))
            if tag == NAME_END:
                self._start_json(announce=bool(self._name))
                return
            if not self._name:
                if tag == ARG_KEY_START:
                    self._state = _State.DISCARD
                else:
                    self._end_call()
                return
            self._announce()
            if tag == ARG_KEY_START:
                self._start_key()
            else:
                self._close_call()
        elif tag == TOOL_CALL_END:
            if state is _State.VALUE:
                self._end_value()
            if state is _State.DISCARD:
                self._end_call()
            else:
                self._close_call()
        elif state is _State.KEY:  # </arg_key>
            self._key = "".join(self._parts).strip()
            self._state = _State.AWAIT_VALUE
        elif tag == ARG_KEY_START:  # AWAIT_VALUE drops its key; BETWEEN starts the next pair
            self._start_key()
        elif tag == ARG_VALUE_START:  # AWAIT_VALUE
            self._start_value()
        elif tag == ARG_VALUE_END:  # VALUE
            self._end_value()
            self._state = _State.BETWEEN
        else:  # BETWEEN saw <tool_call>: the previous call only lacked </tool_call>
            self._close_call()
            self._start_call()

    def _content(self, text: str) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if body:
            self._out.content += self._held_ws + body
            self._held_ws = text[len(body) :]
            self._started, self._call_after_content = True, False
        else:
            self._held_ws += text

    def _start_call(self) -> None:
        self._state, self._parts, self._pairs = _State.NAME, [], 0
        self._call_after_content = True
        if not self._started:
            self._held_ws = ""

    def _end_call(self) -> None:
        """Back to content after a call (emitted or dropped)."""
        self._state, self._skip_ws = _State.CONTENT, not self._started

    def _resolve_name(self, name: str) -> str:
        """A namespaced name (`Weather/get_weather`) whose part names a given tool is that tool."""
        names = {(tool.get("function") or {}).get("name") for tool in self._tools or ()}
        if name in names or "/" not in name:
            return name
        return next((part.strip() for part in name.split("/") if part.strip() in names), name)

    def _announce(self) -> None:
        self._index += 1
        self._out.tool_calls.append(
            ToolCallDelta(index=self._index, id=f"call_{uuid.uuid4().hex[:24]}", type="function", name=self._name)
        )

    def _start_json(self, announce: bool) -> None:
        self._state, self._emit_json = _State.JSON, announce
        self._json_depth, self._json_string, self._json_escape = 0, False, False
        if announce:
            self._announce()

    def _scan_json(self, text: str, pos: int) -> int:
        """Stream the arguments object (raw, as generated) until it closes; returns where scanning stopped.

        Before the object only whitespace may come: anything else means the call has no arguments
        (`{}`) and is content or markup again. Outside strings, a tool-call tag ends the call where
        it stands (the arguments stay cut, as at the end of output); a partial one is held back.
        """
        begin = pos
        while pos < len(text):
            char = text[pos]
            if not self._json_depth:
                if char.isspace():
                    pos = begin = pos + 1
                    continue
                if char != "{":
                    self._finish_json("{}")
                    return pos
                self._json_depth = 1
            elif self._json_string:
                if self._json_escape:
                    self._json_escape = False
                elif char == "\\":
                    self._json_escape = True
                elif char == '"':
                    self._json_string = False
            elif char == '"':
                self._json_string = True
            elif char in "{[":
                self._json_depth += 1
            elif char in "}]":
                self._json_depth -= 1
                if not self._json_depth:
                    self._finish_json(text[begin:pos + 1])
                    return pos + 1
            elif char == "<":
                rest = text[pos:pos + len(TOOL_CALL_END)]
                if rest.startswith(TOOL_CALL_START) or rest.startswith(TOOL_CALL_END):
                    self._finish_json(text[begin:pos])
                    return pos
                if any(tag.startswith(rest) for tag in (TOOL_CALL_START, TOOL_CALL_END)):
                    break  # the end of the text may still become a tag
            pos += 1
        if self._emit_json and pos > begin:
            self._arguments(text[begin:pos])
        return pos

    def _finish_json(self, arguments: str) -> None:
        if self._emit_json and arguments:
            self._arguments(arguments)
        self._end_call()

    def _start_key(self) -> None:
        self._state, self._parts = _State.KEY, []

    def _start_value(self) -> None:
        self._state, self._parts = _State.VALUE, []
        self._string_value = self._key in self._string_params.get(self._name, ())
        if self._string_value:
            self._arguments(self._pair_prefix() + '"')

    def _end_value(self) -> None:
        if self._string_value:
            self._arguments('"')
        else:
            self._arguments(self._pair_prefix() + _json_value("".join(self._parts)))

    def _pair_prefix(self) -> str:
        """``{`` or ``, `` then the key: the start of the next pair, as ``json.dumps`` separates."""
        self._pairs += 1
        return ("{" if self._pairs == 1 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "

    def _close_call(self) -> None:
        self._arguments("}" if self._pairs else "{}")
        self._end_call()

    def _arguments(self, text: str) -> None:
        """Append argument text to the current call, merging with its last piece in this delta."""
        pieces = self._out.tool_calls
        if pieces and pieces[-1].index == self._index:
            pieces[-1].arguments += text
        else:
            pieces.append(ToolCallDelta(index=self._index, arguments=text))
