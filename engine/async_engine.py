"""The engine in its own thread, fed and drained from asyncio: the event loop never waits on a forward pass.

`generate()` returns an async iterator of deltas per request: new token ids, the text they add
(incrementally detokenized, stop strings applied), logprobs, and the finish reason at the end.
Leaving the iterator early (client disconnect, cancellation) aborts the request; the engine frees
its slot and pages before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from tokenizers import Tokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore, EngineStats, RequestPhases, StepOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFull
from engine.sequence import Sequence, TokenLogprobs
from engine.vision.placement import PlacedImage

log = logging.getLogger("glmflash.engine")


class EngineError(RuntimeError):
    """The forward pass failed for the requests in this step; the engine keeps serving others."""


@dataclass
class GenerationDelta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # Per token: characters of output text before it (a token inside a multi-byte character is counted
    # where that character starts).
    text_offsets: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (the same in every delta)
    prompt_logprobs: list[TokenLogprobs] | None = None  # in the first delta, when the params ask (prompt tokens 1..)
    phases: RequestPhases | None = None  # in the first delta: where its time to first token went in the engine


class _RequestStream:
    """One request's deltas (an async iterator). `aclose()` aborts the request, also when no delta was read yet:
    closing a never-started async generator does not run its `finally`, so the request would stay queued."""

    def __init__(self, engine: "AsyncEngine", request_id: str, deltas: AsyncIterator[GenerationDelta]) -> None:
        self._engine, self._request_id, self._deltas = engine, request_id, deltas

    def __aiter__(self) -> "_RequestStream":
        return self

    def __anext__(self):
        return self._deltas.__anext__()

    async def aclose(self) -> None:
        await self._deltas.aclose()
        if self._engine._streams.pop(self._request_id, None) is not None:  # never started
            self._engine.abort(self._request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer | None = None) -> None:
        self.core, self.tokenizer = core, tokenizer
        self.stats: EngineStats = core.stats()
        self._cv = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="glmflash-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (queued or running)."""
        return len(self._streams)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError if the request can never fit this engine (context length)."""
        self.core.check(prompt_len, max_tokens)

    @property
    def accepts_images(self) -> bool:
        return self.core.accepts_images

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       images: tuple[PlacedImage, ...] = ()) -> AsyncIterator[GenerationDelta]:
        """Submit a request and iterate over its deltas. Raises QueueFull or ValueError (GrammarError for a
        grammar that does not compile) before the first one. `images`: where the prompt's images sit
        (`engine.vision.placement.place_images`)."""
        request_id = request_id or uuid.uuid4().hex
        self.check(len(prompt_token_ids), params.max_tokens)
        if images and not self.accepts_images:
            raise ValueError("this model has no vision tower: it answers text only")
        # A grammar is compiled here, off the engine thread: a large one must not stall everyone's next step.
        constraint = (await asyncio.to_thread(self.core.constraint, request_id, params) if params.grammar is not None
                      else self.core.constraint(request_id, params))
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            waiting = self.core.num_waiting + len(self._incoming)
            if waiting >= self.core.max_waiting:
                raise QueueFull(f"{waiting} requests already waiting")
            self._streams[request_id] = queue
            self._incoming.append(Sequence(request_id, list(prompt_token_ids), params, constraint=constraint,
                                           images=images))
            self._cv.notify()
        return _RequestStream(self, request_id, self._deltas(request_id, prompt_token_ids, params, queue))

    async def _deltas(self, request_id: str, prompt: list[int], params: SamplingParams,
                      queue: asyncio.Queue) -> AsyncIterator[GenerationDelta]:
        detok = (IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens, params.stop)
                 if self.tokenizer is not None else None)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                delta = self._delta(item, params, detok)
                finished = delta.finish_reason is not None
                if finished and item[-1].finish_reason is None:  # a stop string ended it before the engine did
                    self.abort(request_id)
                yield delta
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    @staticmethod
    def _delta(outputs: list[StepOutput], params: SamplingParams,
               detok: IncrementalDetokenizer | None) -> GenerationDelta:
        delta = GenerationDelta([], "", cached_tokens=outputs[0].cached_tokens,
                                prompt_logprobs=outputs[0].prompt_logprobs, phases=outputs[0].phases)
        for out in outputs:
            delta.token_ids.append(out.token_id)
            delta.text_offsets.append(detok.decoded_chars if detok is not None else 0)
            if out.logprobs is not None:
                delta.logprobs.append(out.logprobs)
            stop_token = out.finish_reason == "stop"
            if detok is not None and not stop_token:  # a stop token's own text is never part of the output
                delta.text += detok.push(out.token_id)
                if detok.stopped:
                    delta.finish_reason = "stop"
                    return delta
            if out.finish_reason is not None:
                if detok is not None:
                    delta.text += detok.flush()
                delta.finish_reason = out.finish_reason
        return delta

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def abort_all(self) -> None:
        """Abort every accepted request (end of a drain's grace period)."""
        with self._cv:
            self._aborts.extend(self._streams)
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._aborts or self.core.has_work or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                if not self.core.abort(request_id):
                    self._discard_incoming(request_id, incoming)
            for seq in incoming:
                try:
                    self.core.add(seq)
                except (QueueFull, ValueError) as exc:
                    self._deliver({seq.request_id: exc})
            if self.core.has_work:
                self._step()
            self.stats = self.core.stats()

    @staticmethod
    def _discard_incoming(request_id: str, incoming: list[Sequence]) -> None:
        incoming[:] = [s for s in incoming if s.request_id != request_id]

    def _step(self) -> None:
        running = self.core.running_ids()
        try:
            outputs = self.core.step()
        except Exception as exc:  # keep serving: fail this step's requests, not the process
            log.exception("event=engine_step_failed")
            # Also those the step admitted: their prompt may have run without a token sampled, leaving
            # nothing to run next step (a zero-token forward that fails every request batched with it).
            running += [rid for rid in self.core.running_ids() if rid not in running]
            failed = {rid: EngineError(f"engine step failed: {exc}") for rid in running}
            for rid in running:
                self.core.abort(rid)
            self._deliver(failed)
            return
        grouped: dict[str, list[StepOutput]] = {}
        for out in outputs:
            grouped.setdefault(out.request_id, []).append(out)
        self._deliver(grouped)

    def _deliver(self, items: dict[str, list[StepOutput] | Exception]) -> None:
        if items and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: dict[str, list[StepOutput] | Exception]) -> None:
        for request_id, item in items.items():
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(item)
