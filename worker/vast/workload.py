"""Workload units (one definition for admission, cur_load and the benchmark): see `workload_of`."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

DEFAULT_WORKLOAD = 100.0  # worker.py DEFAULT_WORKLOAD: what a body we cannot price counts
CHARS_PER_TOKEN = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (and ours)


def _text_units(text: str, count_tokens: Callable[[str], int] | None) -> int:
    return count_tokens(text) if count_tokens else math.ceil(len(text) / CHARS_PER_TOKEN)


def _strings(value: Any) -> list[str]:
    """Every string leaf of a JSON value (message contents, text parts, tool-call names and arguments); an image
    part's URL is no text (a base64 image would price as a huge prompt), and its tokens are known only once
    decoded, so it is left out."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        if value.get("type") == "image_url":
            return []
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def workload_of(body: Any, *, default_max_tokens: int = 256,
                count_tokens: Callable[[str], int] | None = None) -> float:
    """Workload units of one OpenAI request: what Vast calls cost / load / perf, in tokens.

        workload = n x (prompt tokens + max_tokens), summed over the prompts of a /v1/completions batch

    * prompt tokens: exact for token-id prompts; for text, `count_tokens(text)` when given, else
      ceil(chars / 4) (a body is priced before it is tokenized). Chat counts the text of every message (string
      content, text parts, tool-call names and arguments) plus the JSON of `tools`; images are not priced.
    * max_tokens: `max_completion_tokens`, else `max_tokens`, else 16 for /v1/completions (OpenAI's default, and
      the server's) or `default_max_tokens` for chat (whose real cap is the rest of the context).

    The benchmark prices its requests with this same function, so `max_perf` (units/s), `cur_load` and the queue
    time estimate share one unit. A body it cannot read counts DEFAULT_WORKLOAD (100), as in the framework.
    """
    if not isinstance(body, dict):
        return DEFAULT_WORKLOAD
    n = _positive_int(body.get("n")) or 1
    limit = _positive_int(body.get("max_completion_tokens"))
    limit = limit if limit is not None else _positive_int(body.get("max_tokens"))
    if "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return DEFAULT_WORKLOAD
        text = "".join(_strings(messages))
        if body.get("tools"):
            text += json.dumps(body["tools"], separators=(",", ":"))
        prompts = [_text_units(text, count_tokens)]
        limit = default_max_tokens if limit is None else limit
    elif "prompt" in body:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [_text_units(prompt, count_tokens)]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [len(prompt)]
        elif isinstance(prompt, list) and prompt:
            prompts = []
            for item in prompt:
                if isinstance(item, str):
                    prompts.append(_text_units(item, count_tokens))
                elif isinstance(item, list):
                    prompts.append(len(item))
                else:
                    return DEFAULT_WORKLOAD
        else:
            return DEFAULT_WORKLOAD
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit
    else:
        return DEFAULT_WORKLOAD
    return float(n * sum(p + limit for p in prompts))
