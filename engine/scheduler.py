"""Who runs next: continuous batching with chunked prefill under a per-step token budget.

Every step first gives each decoding request its one token, then spends what is left of the
budget on prefill chunks (requests already prefilling first, then newly admitted ones), so a
long prompt never stalls running decodes; a step with no decoding request may take a larger budget
(`max_prefill_tokens`: fewer, longer chunks for a lone long prompt). A prefill the prefix cache stops one
token short, to snapshot there, runs on through its last token in the same step when the budget allows (its state is saved partway
through the step); otherwise, a step where some prompt has only its last token left runs those tokens
and the decodes alone: a one-token step is a decode step (a CUDA graph), so that request's first token
does not wait for a step of other requests' prefill chunks, which start one short step later.
A request is admitted when a state slot and the cache pages for prompt + max_tokens are free; it
reserves them, so it never waits for memory later.
The waiting queue is bounded: past it `add` raises QueueFull and the caller answers "retry later".

A step is plain data (engine/step_plan.py): `schedule` plans it, the runner computes it, and `update` is
the one place a request advances: its computed tokens, the prefix cache's records, its sampled token,
its finish (a finished request's slot and pages are freed there).

With a prefix cache, admission starts a request from its longest cached prefix (cached pages it
reuses are not reserved again, cached pages nobody uses are evicted to make room), prefill chunks
end where the cache wants a snapshot, and a request whose prompt another request is still
prefilling waits for that prefix instead of computing it a second time.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from engine.cache import PagedLatents, RequestSlots
from engine.cache.prefix_cache import PrefixCache, PrefixHit
from engine.sequence import Sequence, TokenLogprobs
from engine.step_plan import StepPlan, StepResult

PROMPT_LOGPROB_CHUNK = 512  # prompt tokens per step of a request that asks for their logprobs


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the request was not taken."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048  # tokens per forward step (decodes + prefill chunks)
    max_waiting: int = 256
    max_prefill_tokens: int | None = None  # tokens per step when none of it decodes (None: max_num_batched_tokens)

    def budget(self, generating: bool) -> int:
        """Tokens of the next step: while some request generates, max_num_batched_tokens, so its next tokens never
        wait on a longer chunk; a step of prompts alone may take max_prefill_tokens."""
        return self.max_num_batched_tokens if generating or self.max_prefill_tokens is None else \
            self.max_prefill_tokens


class Scheduler:
    def __init__(self, slots: RequestSlots, cache: PagedLatents, limits: SchedulerLimits,
                 prefix: PrefixCache | None = None) -> None:
        if limits.max_num_batched_tokens < slots.num_slots:
            raise ValueError("max_num_batched_tokens must be at least the number of request slots")
        self.slots, self.cache, self.limits, self.prefix = slots, cache, limits, prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError if a request can never run here."""
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        if prompt_len + max_tokens > self.limits.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"limit of {self.limits.max_model_len} tokens")

    def add(self, seq: Sequence) -> None:
        self.check(len(seq.prompt_token_ids), seq.params.max_tokens)
        if len(self.waiting) >= self.limits.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def running_ids(self) -> list[str]:
        return [seq.request_id for seq in self.running]

    def schedule(self) -> StepPlan:
        """The next step: every decoding request's token, then prefill chunks within the token budget."""
        started = time.perf_counter()
        plan = self._plan()
        saves = self.prefix.step_saves(self.cache.latents.device) if self.prefix else None
        return StepPlan.of(plan, saves, started=started)

    def _plan(self) -> list[tuple[Sequence, int]]:
        plan: dict[Sequence, int] = {}
        decoding = [s for s in self.running if s.num_to_compute == 1 and s.num_computed >= len(s.prompt_token_ids)]
        # Any request past its prompt (a verify's restored request runs several tokens again) keeps steps short.
        budget = self.limits.budget(any(s.num_computed >= len(s.prompt_token_ids) for s in self.running))
        prefilling = [s for s in self.running if s not in decoding]
        finishing = [s for s in prefilling if s.num_to_compute == 1]
        if finishing:  # prompts' last tokens (the prefix cache held them back for a snapshot)
            return [(seq, 1) for seq in decoding + finishing]
        for seq in decoding:
            plan[seq] = 1
            budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            plan[seq] = self._chunk(seq, budget)
            budget -= plan[seq]
        for seq in list(self.waiting):
            if budget <= 0:
                break
            reuse = self.prefix is not None and seq.params.prompt_logprobs is None  # those need every position
            hit = self.prefix.lookup(seq.prompt_keys) if reuse else PrefixHit()
            owner = self.prefix.wait_for(seq, hit, self.running) if reuse else None
            if owner is not None:  # it will find the prefix cached once `owner` got there
                if owner in plan:
                    budget += plan[owner] - (cut := self._chunk(owner, plan[owner]))
                    plan[owner] = cut
                continue
            if not self.try_admit(seq, hit):
                break
            self.waiting.remove(seq)
            plan[seq] = self._chunk(seq, budget)
            budget -= plan[seq]
        return list(plan.items())

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to run now: what it has pending, within the budget, up to its next snapshot stop
        (through the prompt's last token when the stop is the one before it and the step can save the state
        there); a request scoring its prompt (prompt logprobs) at most PROMPT_LOGPROB_CHUNK, as each of its
        tokens brings a row of logits (0.6 GB per 1,000 tokens at the release's vocabulary)."""
        limit = self.prefix.chunk_limit(seq) if self.prefix else None
        scored = PROMPT_LOGPROB_CHUNK if seq.params.prompt_logprobs is not None else seq.num_to_compute
        tokens = min(seq.num_to_compute, budget, limit or seq.num_to_compute, scored)
        return self.prefix.through_last(seq, tokens, budget) if self.prefix else tokens

    def try_admit(self, seq: Sequence, hit: PrefixHit | None = None) -> bool:
        """Reserve a slot and the request's pages and mark it running, if both are free. `hit` (from the
        prefix cache's lookup) is where the request starts; None starts it from zero."""
        pages = self.cache.pages_for(len(seq.prompt_token_ids) + seq.params.max_tokens)
        if not self.slots.free_count:
            return False
        if self.prefix is None:
            if pages > self.cache.free_pages:
                return False
            seq.slot, seq.pages = self.slots.allocate(), self.cache.allocate(pages)
        else:
            slot = self.slots.allocate()
            reserved = self.prefix.admit(seq, hit or PrefixHit(), slot, pages)
            if reserved is None:
                self.slots.release(slot)
                return False
            seq.slot, seq.pages = slot, reserved
        self.running.append(seq)
        return True

    def admit_now(self, seq: Sequence) -> None:
        """Admit `seq` outside the queue, for a prompt scored whole (prompt logits); RuntimeError when no slot or
        pages are free."""
        self.check(len(seq.prompt_token_ids), seq.params.max_tokens)
        if not self.try_admit(seq):
            raise RuntimeError("no free slot or cache pages for the prompt")

    @contextmanager
    def prefix_cache_off(self) -> Iterator[None]:
        """Requests scheduled meanwhile neither use nor fill the prefix cache (warm-up's random prompts)."""
        prefix, self.prefix = self.prefix, None
        try:
            yield
        finally:
            self.prefix = prefix

    def advance(self, plan: StepPlan, result: StepResult) -> None:
        """The step ran: its requests' computed tokens, prompt logprobs and first step's time, and the prefix
        cache's records of them (a verifying request's after its verdict, in `update`)."""
        for span in plan.spans:
            span.seq.started = plan.started if span.seq.started is None else span.seq.started
            span.seq.num_computed += span.num_new
            span.seq.prompt_logprobs.extend(result.prompt_logprobs.get(span.seq, ()))
            if self.prefix is not None and span.seq not in plan.drafts:
                self.prefix.commit(span.seq)

    def update(self, plan: StepPlan, result: StepResult, sampled: list[tuple[int, TokenLogprobs | None]],
               eos_token_ids: tuple[int, ...], after_drafts: dict[Sequence, list[int]] | None = None,
               restore: Callable[[Sequence], None] | None = None) -> list[Sequence]:
        """The one place requests advance after a step: `advance`, then each sampled token appended (and taken
        by the request's constraint), drafts verified, finishes decided and the finished requests' slots and
        pages freed. `after_drafts`: for each drafted request, the tokens after its first (its accepted drafts and
        the one after them). Where every draft was accepted and every token appended, the drafts' positions count as
        computed; otherwise (a finish cut them too: the state at the last would hold a token after it) `restore(seq)` puts the request's state back to before the step (the drafts' positions left
        their traces in it) and its tokens run again with the new ones. -> the finished requests."""
        self.advance(plan, result)
        finished = []
        for seq, (token, _) in zip(plan.to_sample, sampled):
            tokens = [token] + (after_drafts or {}).get(seq, [])
            appended = 0
            for new in tokens:
                seq.append(new, eos_token_ids)
                appended += 1
                if seq.constraint is not None:
                    seq.constraint.accept(new)
                if seq.finished:
                    break
            drafts = plan.drafts.get(seq)
            if drafts is not None:
                if appended == len(drafts) + 1:  # all accepted and taken: the state holds them
                    seq.num_computed += len(drafts)
                else:
                    seq.num_computed = seq.num_computed - next(s.num_new for s in plan.spans if s.seq is seq)
                    restore(seq)
                if self.prefix is not None:
                    self.prefix.commit(seq)
            if seq.finished:
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted request's slot and pages (it may still be waiting)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self.running.remove(seq)
        if self.prefix is not None:  # an engine-finished request's state is whole; an aborted one's may not be
            self.prefix.finish(seq, keep_state=seq.finish_reason in ("stop", "length"))
        self.slots.release(seq.slot)
        self.cache.release(seq.pages)
        seq.slot, seq.pages = None, []
