"""What a request constrains its output to, independent of any tokenizer: the engine compiles it.

`GrammarSpec` names a JSON schema, a regular expression, a list of choices or a grammar (Lark, or
GBNF/EBNF as llama.cpp and vLLM write it). JSON is generated compact and bounded by the schema: no
free whitespace (a model, or a random one, could otherwise emit whitespace forever), `", "` between
items and `": "` after keys, the separators `json.dumps` writes.

`Reasoning` says the output starts inside reasoning closed by one token (GLM's `</think>`): the
grammar applies only after that token, as in vLLM, and a budget can force it.

The `lark_*` helpers build grammars that embed JSON schemas and single tokens (a tool call's
start tag) for callers that compose their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "choice", "grammar"]

# llguidance's JSON options (also accepted inside a schema as "x-guidance").
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """`source`: the schema as JSON text, the pattern, the choices as a JSON list, or the grammar text."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(choices)))


@dataclass(frozen=True)
class Reasoning:
    """The output opens in reasoning that `end_token_id` closes; `budget` reasoning tokens at most
    (then that token is forced), None for no limit."""

    end_token_id: int
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError("the reasoning budget must be >= 0")


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark expression matching one JSON value of `schema`, formatted as `JSON_FORMAT` says."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT})


def lark_literal(text: str) -> str:
    return json.dumps(text)


def lark_token(token_id: int) -> str:
    """One specific token (a special or added token such as `<tool_call>`), not its text spelled in bytes."""
    return f"<[{token_id}]>"
