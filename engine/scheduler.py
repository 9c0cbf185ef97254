"""Who runs next: continuous batching with chunked prefill under a per-step token budget.

Every step first gives each decoding request its one token, then spends what is left of the
budget on prefill chunks (requests already prefilling first, then newly admitted ones), so a
long prompt never stalls running decodes. A request is admitted when a state slot and the cache
pages for prompt + max_tokens are free; it reserves them, so it never waits for memory later.
The waiting queue is bounded: past it `add` raises QueueFull and the caller answers "retry later".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.cache import PagedLatents, RequestSlots
from engine.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]  # (request, tokens to run this step)


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the request was not taken."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048  # tokens per forward step (decodes + prefill chunks)
    max_waiting: int = 256


class Scheduler:
    def __init__(self, slots: RequestSlots, cache: PagedLatents, limits: SchedulerLimits) -> None:
        if limits.max_num_batched_tokens < slots.num_slots:
            raise ValueError("max_num_batched_tokens must be at least the number of request slots")
        self.slots, self.cache, self.limits = slots, cache, limits
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

    def schedule(self) -> Scheduled:
        budget = self.limits.max_num_batched_tokens
        step: Scheduled = []
        decoding = [s for s in self.running if s.pending == 1 and s.cached >= len(s.prompt_token_ids)]
        prefilling = [s for s in self.running if s not in decoding]
        for seq in decoding:
            step.append((seq, 1))
            budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            n = min(seq.pending, budget)
            step.append((seq, n))
            budget -= n
        while budget > 0 and self.waiting and self.try_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            n = min(seq.pending, budget)
            step.append((seq, n))
            budget -= n
        return step

    def try_admit(self, seq: Sequence) -> bool:
        """Reserve a slot and the request's pages and mark it running, if both are free."""
        pages = self.cache.pages_for(len(seq.prompt_token_ids) + seq.params.max_tokens)
        if not self.slots.free_count or pages > self.cache.free_pages:
            return False
        seq.slot, seq.pages = self.slots.allocate(), self.cache.allocate(pages)
        self.running.append(seq)
        return True

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted request's slot and pages (it may still be waiting)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self.running.remove(seq)
        self.slots.release(seq.slot)
        self.cache.release(seq.pages)
        seq.slot, seq.pages = None, []
