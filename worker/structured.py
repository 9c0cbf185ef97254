"""Structured-output requests -> the engine's grammar and reasoning constraints.

The grammar comes from one of `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` or its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, or `tool_choice` "required" / a named function. Tool calls are forced in
GLM-5.3-Flash's JSON form, `<tool_call>name>{arguments}` (the `<tool_call>` token itself, then the
name, then an object of the tool's `parameters` schema), which the GLM tool parser reads back.

With thinking on (the prompt ends inside `<think>`) the grammar applies after `</think>`, as in
vLLM; a structured request may not stop while reasoning, and its reasoning is capped so the answer
keeps room: at `thinking_token_budget` tokens when the request gives one (-1: no cap), else at half
of `max_tokens`, after which `</think>` is forced.
"""

from __future__ import annotations

from typing import Any

from engine.structured import GrammarSpec, Reasoning, lark_json, lark_literal, lark_token
from worker.parsers.reasoning import THINK_END
from worker.parsers.tool_calls import NAME_END, TOOL_CALL_START
from worker.protocol import ChatCompletionRequest, NamedToolChoice, ProtocolError, StructuredOutputRequest, _SamplingRequest
from worker.served_model import ServedModel

# OpenAI: a function declared without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def output_grammar(body: _SamplingRequest) -> tuple[GrammarSpec, str] | None:
    """The grammar of `response_format` / `structured_outputs` / `guided_*`, and the field it came from."""
    request = body.structured_output
    return None if request is None else (_spec(request), request.param)


def _spec(request: StructuredOutputRequest) -> GrammarSpec:
    if request.kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if request.kind == "json_schema":
        return GrammarSpec.json_schema(request.value)
    if request.kind == "choice":
        return GrammarSpec.choice(request.value)
    return GrammarSpec(request.kind, request.value)  # regex, grammar


def tool_call_grammar(body: ChatCompletionRequest, model: ServedModel) -> tuple[GrammarSpec, str] | None:
    """For tool_choice "required" (one call or, with parallel_tool_calls, several) or a named function
    (exactly one call of it): calls in the JSON form, arguments valid against each tool's schema."""
    choice = body.tool_choice
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return None
    tools = [t.function for t in body.tools]
    if isinstance(choice, NamedToolChoice):
        tools = [f for f in tools if f.name == choice.function.name]
    start = model.tokenizer.token_to_id(TOOL_CALL_START)
    opener = lark_token(start) if start is not None else lark_literal(TOOL_CALL_START)
    rules = [f"call_{i}: {opener} {lark_literal(f.name + NAME_END)} {lark_json(f.parameters or NO_PARAMETERS)}"
             for i, f in enumerate(tools)]
    several = choice == "required" and body.parallel_tool_calls is not False
    lines = [f"start: call{'+' if several else ''}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    return GrammarSpec("grammar", "\n".join(lines + rules)), "tools"


def reasoning_limit(body: ChatCompletionRequest, model: ServedModel, in_reasoning: bool, structured: bool,
                    max_tokens: int) -> Reasoning | None:
    """Where the output's reasoning ends and how long it may run, when that matters: a structured answer
    or a `thinking_token_budget` while the prompt opened reasoning."""
    given = body.thinking_token_budget  # -1: explicitly no limit
    if not in_reasoning or not (structured or given not in (None, -1)):
        return None
    end = model.tokenizer.token_to_id(THINK_END)
    if end is None:
        raise ProtocolError(f"this model's tokenizer has no single {THINK_END} token to end reasoning with; "
                            'send "chat_template_kwargs": {"enable_thinking": false}', param="chat_template_kwargs")
    budget = given if given is not None else max_tokens // 2
    return Reasoning(end, None if budget == -1 else budget)
