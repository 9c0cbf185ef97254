"""POST /v1/completions: raw prompts (text or token ids) in, text out, streamed or whole."""

from __future__ import annotations

from typing import AsyncIterator

from aiohttp import web

from engine.async_engine import GenerationDelta
from engine.detokenizer import IncrementalDetokenizer
from engine.sequence import TokenLogprobs
from worker.protocol import (
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage,
    random_id,
)
from worker.served_model import ServedModel
from worker.structured import output_grammar
from worker.serving import (
    STATE, Timing, cached_prompt_tokens, check_model, check_token_ids, close_streams, collect, completion_budget, merged,
    open_streams, read_request, sampling_params, serve_sse, top_logprobs,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class LogprobBuilder:
    """OpenAI's parallel-list completion logprobs, token by token. `text_offset` counts characters of the
    choice's text: where each token's text starts, or for a token inside a multi-byte character, where
    that character starts. With echo the echoed prompt's tokens come first, the first one without a
    logprob (nothing precedes it)."""

    def __init__(self, model: ServedModel, prompt: list[int] | None, echo: str) -> None:
        """prompt: the prompt's ids when its logprobs are echoed too; echo: the echoed text ("" without)."""
        self.model, self.prompt, self.prefix_chars = model, prompt, len(echo)

    def add(self, delta: GenerationDelta) -> CompletionLogprobs | None:
        out = self._prompt(delta.prompt_logprobs) if delta.prompt_logprobs is not None and self.prompt else None
        if not delta.logprobs:
            return out
        out = out or CompletionLogprobs()
        for token, lp, text_offset in zip(delta.token_ids, delta.logprobs, delta.text_offsets):
            self._append(out, token, lp, self.prefix_chars + text_offset)
        return out

    def _prompt(self, logprobs: list[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        detok = IncrementalDetokenizer(self.model.tokenizer, skip_special_tokens=False)
        for index, token in enumerate(self.prompt):
            self._append(out, token, logprobs[index - 1] if index else None, detok.decoded_chars)
            detok.push(token)
        return out

    def _append(self, out: CompletionLogprobs, token: int, lp: TokenLogprobs | None, text_offset: int) -> None:
        out.tokens.append(self.model.token_text(token))
        out.token_logprobs.append(lp.logprob if lp is not None else None)
        top: dict[str, float] | None = None
        if lp is not None:
            top = {}
            for top_text, value in top_logprobs(self.model, lp):  # best first
                top.setdefault(top_text, value)  # texts can collide (lone bytes read "\ufffd"): keep the best
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)


def merge_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    whole = CompletionLogprobs()
    for part in parts:
        whole.tokens += part.tokens
        whole.token_logprobs += part.token_logprobs
        whole.top_logprobs += part.top_logprobs
        whole.text_offset += part.text_offset
    return whole


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    model: ServedModel = state.require_model()
    body = await read_request(request, CompletionRequest)
    check_model(body.model, model)
    prompts: list[list[int]] = []
    for prompt in body.prompts:
        ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_token_ids(ids, model, "prompt")
        prompts.append(ids)
    max_tokens = min(completion_budget(model, len(ids), body.max_tokens, DEFAULT_MAX_TOKENS, "prompt") for ids in prompts)
    grammar, grammar_param = output_grammar(body) or (None, None)
    # echo with logprobs: the prompt's logprobs too
    params = sampling_params(body, model, max_tokens, body.logprobs, grammar,
                             prompt_logprobs=body.logprobs if body.echo else None)
    echoes = [model.tokenizer.decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts]
    builders = [LogprobBuilder(model, ids if params.prompt_logprobs is not None else None, echo)
                for ids, echo in zip(prompts, echoes) for _ in range(body.n)]
    echoes = [e for e in echoes for _ in range(body.n)]
    prompt_tokens = sum(len(ids) for ids in prompts)
    timing = Timing(state.metrics)
    streams = await open_streams(model, prompts, params, body.n, grammar_param)
    try:  # whatever happens before the streams are read (client gone, cancelled), they are aborted
        if body.stream:
            return await _stream(request, body, model, streams, echoes, builders, prompt_tokens, timing)
        return await _whole(body, model, streams, echoes, builders, prompt_tokens, timing)
    finally:
        await close_streams(streams)


async def _stream(request: web.Request, body: CompletionRequest, model: ServedModel, streams, echoes: list[str],
                  builders: list[LogprobBuilder], prompt_tokens: int, timing: Timing) -> web.StreamResponse:
    return await serve_sse(request, _chunks(body, model, streams, echoes, builders, prompt_tokens, timing))


async def _chunks(body: CompletionRequest, model: ServedModel, streams, echoes: list[str],
                  builders: list[LogprobBuilder], prompt_tokens: int, timing: Timing) -> AsyncIterator[CompletionChunk]:
    chunk_id, completion_tokens = random_id("cmpl"), 0
    started, cached = [False] * len(streams), [0] * len(streams)
    events = merged(streams)
    try:
        async for index, delta in events:
            completion_tokens += len(delta.token_ids)
            cached[index] = delta.cached_tokens
            timing.tokens(index, delta)
            text = delta.text if started[index] else echoes[index] + delta.text
            started[index] = True
            choice = CompletionChoice(index=index, text=text, logprobs=builders[index].add(delta),
                                      finish_reason=delta.finish_reason)
            yield CompletionChunk(id=chunk_id, model=model.name, choices=[choice])
        if body.include_usage:
            yield CompletionChunk(id=chunk_id, model=model.name, usage=Usage.of(
                prompt_tokens, completion_tokens, cached_tokens=cached_prompt_tokens(cached, body.n)))
    finally:
        await events.aclose()
        timing.finish(prompt_tokens, completion_tokens)


async def _whole(body: CompletionRequest, model: ServedModel, streams, echoes: list[str],
                 builders: list[LogprobBuilder], prompt_tokens: int, timing: Timing) -> web.Response:
    done = await collect(streams, timing, prompt_tokens, echoes)
    texts, reasons, completion_tokens = done.texts, done.finish_reasons, done.completion_tokens
    logprobs = [[part for d in deltas if (part := builder.add(d)) is not None]
                for builder, deltas in zip(builders, done.deltas)]
    choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                logprobs=merge_logprobs(logprobs[i]) if body.logprobs is not None else None)
               for i in range(len(streams))]
    usage = Usage.of(prompt_tokens, completion_tokens, cached_tokens=cached_prompt_tokens(done.cached, body.n))
    response = CompletionResponse(model=model.name, choices=choices, usage=usage)
    return web.json_response(text=response.model_dump_json())
