"""POST /v1/chat/completions: chat template (and images) in, reasoning / content / tool calls out, streamed or
whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from aiohttp import web

from engine.async_engine import GenerationDelta
from engine.vision.placement import PlacedImage
from worker.chat_template import RenderedPrompt, TemplateError
from worker.images import check_images, image_refs, load_images
from worker.parsers import (
    REASONING_PARSERS, TOOL_PARSERS, GlmReasoningParser, GlmToolParser, ReasoningDelta, ToolStreamDelta,
)
from worker.protocol import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionChunkChoice, ChatCompletionLogprobs,
    ChatCompletionMessage, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionTokenLogprob,
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ProtocolError, ToolCall, TopLogprob, Usage,
    random_id,
)
from worker.served_model import ServedModel
from worker.settings import Settings
from worker.structured import output_grammar, reasoning_limit, tool_call_grammar
from worker.serving import (
    STATE, Timing, cached_prompt_tokens, check_model, close_streams, collect, completion_budget, merged, open_streams,
    read_request, sampling_params, serve_sse, top_logprobs,
)


class ChoiceParser:
    """Splits one choice's text into reasoning, content and tool calls as it streams."""

    def __init__(self, reasoning: GlmReasoningParser | None, tools: GlmToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.saw_tool_call = False

    def feed(self, text: str) -> DeltaMessage:
        split = self.reasoning.feed(text) if self.reasoning else ReasoningDelta("", text)
        return self._message(split, self.tools.feed(split.content) if self.tools else None)

    def finish(self) -> DeltaMessage:
        """End of output: release held text and close an open tool call."""
        split = self.reasoning.finish() if self.reasoning else ReasoningDelta("", "")
        if self.tools is None:
            return self._message(split, None)
        head, tail = self.tools.feed(split.content), self.tools.finish()
        return self._message(split, ToolStreamDelta(head.content + tail.content, head.tool_calls + tail.tool_calls))

    def _message(self, split: ReasoningDelta, parsed: ToolStreamDelta | None) -> DeltaMessage:
        content, calls = split.content, []
        if parsed is not None:
            content = parsed.content
            calls = [DeltaToolCall(index=d.index, id=d.id, type=d.type,
                                   function=DeltaFunctionCall(name=d.name, arguments=d.arguments or None))
                     for d in parsed.tool_calls]
            self.saw_tool_call |= bool(calls)
        return DeltaMessage(reasoning_content=split.reasoning or None, content=content or None,
                            tool_calls=calls or None)


def make_parser(request: ChatCompletionRequest, model: ServedModel, starts_in_reasoning: bool,
                reasoning_name: str, tool_name: str) -> ChoiceParser:
    reasoning = REASONING_PARSERS[reasoning_name](starts_in_reasoning=starts_in_reasoning) if reasoning_name else None
    use_tools = bool(request.tools) and request.tool_choice != "none" and tool_name
    tools = TOOL_PARSERS[tool_name]([t.model_dump(exclude_none=True) for t in request.tools]) if use_tools else None
    return ChoiceParser(reasoning, tools)


def finish_reason(parser: ChoiceParser, reason: str) -> str:
    return "tool_calls" if parser.saw_tool_call and reason == "stop" else reason


def chat_logprobs(model: ServedModel, delta: GenerationDelta) -> ChatCompletionLogprobs | None:
    if not delta.logprobs:
        return None
    entries = []
    for token, lp in zip(delta.token_ids, delta.logprobs):
        text = model.token_text(token)
        entries.append(ChatCompletionTokenLogprob(
            token=text, logprob=lp.logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top_logprobs(model, lp)]))
    return ChatCompletionLogprobs(content=entries)


def render_chat(body: ChatCompletionRequest, model: ServedModel,
                add_generation_prompt: bool = True) -> RenderedPrompt:
    """The request's messages and tools through the model's chat template (also what /tokenize counts)."""
    if model.template is None:
        raise ProtocolError("this model has no chat template; use /v1/completions", param="messages")
    kwargs = dict(body.chat_template_kwargs or {})
    try:
        return model.template.render(body.template_messages(), tools=body.template_tools(),
                                     add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateError as exc:
        raise ProtocolError(f"chat template error: {exc}", param="messages") from exc


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat request as the engine takes it: each image's run of image tokens in `ids`."""

    text: RenderedPrompt
    ids: list[int]
    images: tuple[PlacedImage, ...] = ()


async def chat_prompt(body: ChatCompletionRequest, model: ServedModel, settings: Settings,
                      add_generation_prompt: bool = True, add_special_tokens: bool = False) -> ChatPrompt:
    """Render and encode the messages, then read the images and expand each one's image token (also what
    /tokenize counts). Images the server refuses outright are refused before anything is rendered or fetched."""
    refs = image_refs(body)
    check_images(refs, model, settings)
    text = render_chat(body, model, add_generation_prompt)
    ids = model.encode(text, add_special_tokens=add_special_tokens)
    if not refs:
        return ChatPrompt(text, ids)
    images = await load_images(refs, model.image_config, settings)
    try:
        ids, placed = model.place_images(ids, images)
    except ValueError as exc:  # a template that drops image parts, or image tokens written as text
        raise ProtocolError(f"the chat template's image placeholders do not match the images: {exc}",
                            param="messages", code="invalid_image") from exc
    return ChatPrompt(text, ids, placed)


def check_image_context(prompt: ChatPrompt, model: ServedModel) -> None:
    """Images can push a text that fits past the context: say so, with the counts (a text that does not fit
    gets completion_budget's answer)."""
    image_tokens = sum(placed.image.num_tokens for placed in prompt.images)
    if image_tokens and len(prompt.ids) - image_tokens < model.max_model_len <= len(prompt.ids):
        raise ProtocolError(f"The images do not fit the context: the prompt is {len(prompt.ids)} tokens, "
                            f"{image_tokens} of them for {len(prompt.images)} image(s), and this model's context "
                            f"limit is {model.max_model_len} tokens.", param="messages",
                            code="context_length_exceeded")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    model: ServedModel = state.require_model()
    body = await read_request(request, ChatCompletionRequest)
    check_model(body.model, model)
    settings = state.settings
    chat = await chat_prompt(body, model, settings)
    check_image_context(chat, model)
    prompt, ids = chat.text, chat.ids
    max_tokens = completion_budget(model, len(ids), body.effective_max_tokens, None, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar, grammar_param = output_grammar(body) or tool_call_grammar(body, model) or (None, None)
    if grammar_param == "tools" and not settings.tool_call_parser:
        raise ProtocolError("tool_choice 'required' or a named function needs a tool-call parser, and this server "
                            "runs without one", param="tool_choice")
    reasoning = reasoning_limit(body, model, prompt.ends_in_reasoning, grammar is not None, max_tokens)
    params = sampling_params(body, model, max_tokens, logprobs, grammar, reasoning)
    parsers = [make_parser(body, model, prompt.ends_in_reasoning, settings.reasoning_parser,
                           settings.tool_call_parser) for _ in range(body.n)]
    timing = Timing(state.metrics)
    streams = await open_streams(model, [ids], params, body.n, grammar_param, chat.images)
    try:  # whatever happens before the streams are read (client gone, cancelled), they are aborted
        if body.stream:
            return await _stream(request, body, model, parsers, streams, len(ids), timing)
        return await _whole(body, model, parsers, streams, len(ids), timing)
    finally:
        await close_streams(streams)


async def _stream(request: web.Request, body: ChatCompletionRequest, model: ServedModel, parsers: list[ChoiceParser],
                  streams, prompt_tokens: int, timing: Timing) -> web.StreamResponse:
    return await serve_sse(request, _chunks(body, model, parsers, streams, prompt_tokens, timing))


async def _chunks(body: ChatCompletionRequest, model: ServedModel, parsers: list[ChoiceParser], streams,
                  prompt_tokens: int, timing: Timing) -> AsyncIterator[ChatCompletionChunk]:
    chunk_id, completion_tokens, cached = random_id("chatcmpl"), 0, [0] * body.n

    def chunk(index: int, delta: DeltaMessage, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=chunk_id, model=model.name,
                                   choices=[ChatCompletionChunkChoice(index=index, delta=delta, **extra)])

    events = merged(streams)
    try:
        for i in range(body.n):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for index, delta in events:
            completion_tokens += len(delta.token_ids)
            cached[index] = delta.cached_tokens
            timing.tokens(index, delta)
            message = parsers[index].feed(delta.text)
            logprobs = chat_logprobs(model, delta)
            if message.model_dump() or logprobs is not None:
                yield chunk(index, message, logprobs=logprobs)
            if delta.finish_reason is not None:
                tail = parsers[index].finish()
                yield chunk(index, tail, finish_reason=finish_reason(parsers[index], delta.finish_reason))
        if body.include_usage:
            yield ChatCompletionChunk(id=chunk_id, model=model.name, usage=Usage.of(
                prompt_tokens, completion_tokens, cached_tokens=cached_prompt_tokens(cached, body.n)))
    finally:
        await events.aclose()
        timing.finish(prompt_tokens, completion_tokens)


async def _whole(body: ChatCompletionRequest, model: ServedModel, parsers: list[ChoiceParser], streams,
                 prompt_tokens: int, timing: Timing) -> web.Response:
    done = await collect(streams, timing, prompt_tokens, [""] * body.n)
    texts, reasons, completion_tokens = done.texts, done.finish_reasons, done.completion_tokens
    logprobs = [[entry for d in deltas if (lp := chat_logprobs(model, d)) for entry in lp.content]
                for deltas in done.deltas]
    choices = []
    for i, parser in enumerate(parsers):
        reasoning, content = (parser.reasoning.extract(texts[i]) if parser.reasoning else (None, texts[i]))
        calls = []
        if parser.tools is not None:
            content, parsed = parser.tools.extract(content or "")
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed]
            parser.saw_tool_call = bool(calls)
        message = ChatCompletionMessage(content=content or None, reasoning_content=reasoning or None,
                                        tool_calls=calls or None)
        choices.append(ChatCompletionChoice(index=i, message=message, finish_reason=finish_reason(parser, reasons[i]),
                                            logprobs=ChatCompletionLogprobs(content=logprobs[i]) if body.logprobs else None))
    usage = Usage.of(prompt_tokens, completion_tokens, cached_tokens=cached_prompt_tokens(done.cached, body.n))
    return web.json_response(text=ChatCompletionResponse(model=model.name, choices=choices,
                                                         usage=usage).model_dump_json())
