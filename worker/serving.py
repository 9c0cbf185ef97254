"""Shared by the chat and completion handlers: request -> engine streams, SSE, limits, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
import json
import logging
import time
from typing import Any, AsyncIterator

from aiohttp import web

from engine.async_engine import GenerationDelta
from engine.sequence import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFull
from engine.structured import GrammarError, GrammarSpec, Reasoning
from engine.vision.placement import PlacedImage
from worker.metrics import Metrics
from worker.protocol import ProtocolError, _SamplingRequest, error_body, parse_request
from worker.served_model import ServedModel
from worker.vast import openai_body

log = logging.getLogger("glmflash.worker")
STATE: web.AppKey = web.AppKey("glmflash_state")  # the app's ServerState
STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection; its requests were aborted."""


async def read_payload(request: web.Request) -> Any:
    """The request's JSON: a Vast-routed request's unwrapped payload, else the body."""
    try:
        return await openai_body(request)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from exc


async def read_request(request: web.Request, cls: type) -> Any:
    return parse_request(cls, await read_payload(request))


def check_model(requested: str | None, model: ServedModel) -> None:
    """A request's `model` names the served one, or none."""
    if requested is not None and requested != model.name:
        raise ProtocolError(f"The model '{requested}' does not exist; this server serves '{model.name}'.",
                            status=404, param="model", code="model_not_found")


def completion_budget(model: ServedModel, prompt_len: int, requested: int | None, default: int | None,
                      prompt_param: str) -> int:
    """max_tokens for a prompt: the requested value, else the default, else the rest of the context."""
    room = model.max_model_len - prompt_len
    if room < 1:
        raise ProtocolError(f"The prompt is {prompt_len} tokens; this model's context limit is "
                            f"{model.max_model_len} tokens, leaving no room to generate.", param=prompt_param,
                            code="context_length_exceeded")
    if requested is not None and requested > room:
        raise ProtocolError(f"max_tokens={requested} plus the {prompt_len}-token prompt exceeds the context limit "
                            f"of {model.max_model_len} tokens (at most {room} here).", param="max_tokens",
                            code="context_length_exceeded")
    return requested if requested is not None else min(default or room, room)


def sampling_params(body: _SamplingRequest, model: ServedModel, max_tokens: int, logprobs: int | None,
                    grammar: GrammarSpec | None = None, reasoning: Reasoning | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            seed=body.seed,
            stop_token_ids=list(body.stop_token_ids or []),
            stop=body.stop_sequences,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            logits_processors=list(model.logits_processors),
            grammar=grammar,
            reasoning=reasoning,
        )
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc


def check_token_ids(ids: list[int], model: ServedModel, param: str) -> None:
    bad = [t for t in ids if t >= model.vocab_size]
    if bad:
        raise ProtocolError(f"token id {bad[0]} is outside the vocabulary (size {model.vocab_size})", param=param)


async def open_streams(model: ServedModel, prompts: list[list[int]], params: SamplingParams, n: int,
                       grammar_param: str | None = None,
                       images: tuple[PlacedImage, ...] = ()) -> list[AsyncIterator[GenerationDelta]]:
    """One engine request per (prompt, sample); seeds differ per sample so n > 1 gives n different answers.
    `images`: where a single prompt's images sit (chat).

    All or nothing: if the queue is full for any of them, the ones already queued are aborted. A grammar
    that does not compile is a 400 naming `grammar_param`, the field it came from.
    """
    streams: list[AsyncIterator[GenerationDelta]] = []
    try:
        for ids in prompts:
            for i in range(n):
                seed = None if params.seed is None else params.seed + i
                sample = dataclasses.replace(params, seed=seed)
                streams.append(await model.engine.generate(ids, sample, images=images))
    except QueueFull as exc:
        await close_streams(streams)
        raise ProtocolError("The server is at capacity; retry shortly.", status=429, code="queue_full") from exc
    except GrammarError as exc:
        await close_streams(streams)
        raise ProtocolError(f"Invalid value for '{grammar_param}': it cannot be compiled into a grammar: {exc}",
                            param=grammar_param, code="invalid_grammar") from exc
    except ValueError as exc:
        await close_streams(streams)
        raise ProtocolError(str(exc), param="max_tokens") from exc
    return streams


async def close_streams(streams: list[AsyncIterator[GenerationDelta]]) -> None:
    for stream in streams:
        await stream.aclose()


async def merged(streams: list[AsyncIterator[GenerationDelta]]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """(choice index, delta) from all streams as they arrive; closing this closes (aborts) them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:  # forwarded so the consumer raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Collected:
    """Every choice's whole output, for non-streamed responses."""

    texts: list[str]
    finish_reasons: list[str]
    deltas: list[list[GenerationDelta]]
    completion_tokens: int
    cached: list[int]  # per choice, prompt tokens restored from the prefix cache


async def collect(streams: list[AsyncIterator[GenerationDelta]], timing: "Timing", prompt_tokens: int,
                  prefixes: list[str]) -> Collected:
    """Read all streams to the end; each choice's text starts with its prefix (echoed prompt or "")."""
    out = Collected(list(prefixes), [""] * len(streams), [[] for _ in streams], 0, [0] * len(streams))
    events = merged(streams)
    try:
        async for index, delta in events:
            out.completion_tokens += len(delta.token_ids)
            timing.tokens(index, delta)
            out.texts[index] += delta.text
            out.deltas[index].append(delta)
            out.cached[index] = delta.cached_tokens
            out.finish_reasons[index] = delta.finish_reason or out.finish_reasons[index]
    finally:
        await events.aclose()
        timing.finish(prompt_tokens, out.completion_tokens)
    return out


def cached_prompt_tokens(per_choice: list[int], n: int) -> int:
    """usage.prompt_tokens_details.cached_tokens: per prompt (n choices each), the prompt tokens its choices found
    cached, the fewest of them (the prompt is counted once, as computed once); summed over prompts."""
    return sum(min(per_choice[i:i + n]) for i in range(0, len(per_choice), n))


class Timing:
    """Per-request latency bookkeeping for the TTFT / inter-token histograms."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.start = metrics, time.perf_counter()
        self.last: dict[int, float] = {}

    def tokens(self, index: int, delta: GenerationDelta) -> None:
        count = len(delta.token_ids)
        if not count:
            return
        now = time.perf_counter()
        if index not in self.last:
            self.metrics.ttft.observe(now - self.start)
            if delta.phases is not None:
                self.metrics.queue_time.observe(delta.phases.queued_s)
                self.metrics.prefill_time.observe(delta.phases.prefill_s)
        else:
            gap = (now - self.last[index]) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self.last[index] = now

    def finish(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(completion_tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.start)


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers=STREAM_HEADERS)
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    try:
        await response.write(f"data: {data}\n\n".encode())
    except (ConnectionError, RuntimeError) as exc:  # reset by peer / closing transport
        raise ClientGone() from exc


async def serve_sse(request: web.Request, payloads: AsyncIterator[Any]) -> web.StreamResponse:
    """Send each payload as an SSE event, then `[DONE]`; a failure after the headers becomes an error event."""
    response = await start_sse(request)
    try:
        async for payload in payloads:
            await send_event(response, payload)
        await send_event(response, "[DONE]")
    except (ClientGone, ConnectionError):
        raise
    except Exception as exc:  # headers are out: report in the stream instead of hanging it
        await send_error_event(response, exc)
    finally:
        await payloads.aclose()
    await response.write_eof()
    return response


async def send_error_event(response: web.StreamResponse, exc: Exception) -> None:
    """A failure after the SSE headers went out: an OpenAI error event, then [DONE], so the stream still ends."""
    log.error("event=stream_failed error=%r", exc)
    status = 429 if isinstance(exc, QueueFull) else 500
    await send_event(response, json.dumps(error_body(status, str(exc) or type(exc).__name__)))
    await send_event(response, "[DONE]")


def top_logprobs(model: ServedModel, lp: TokenLogprobs) -> list[tuple[str, float]]:
    return [(model.token_text(t), v) for t, v in lp.top]
