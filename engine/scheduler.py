"""Who runs next: admit waiting requests while a state slot and their cache pages are free, else decode.

A request reserves pages for prompt + max_tokens on admission, so a running request never waits
for memory mid-generation.
"""

from __future__ import annotations

from collections import deque

from engine.cache import PagedLatents, RequestSlots
from engine.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]  # (request, tokens to run this step)


class Scheduler:
    def __init__(self, slots: RequestSlots, cache: PagedLatents, max_model_len: int) -> None:
        self.slots, self.cache, self.max_model_len = slots, cache, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        need = len(seq.prompt_token_ids) + seq.params.max_tokens
        if not seq.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if need > self.max_model_len:
            raise ValueError(f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.params.max_tokens}) "
                             f"exceeds the context limit of {self.max_model_len}")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Scheduled:
        """A prefill step for newly admitted requests when any fit, otherwise one decode step for all."""
        admitted: Scheduled = []
        while self.waiting and self.slots.free_count:
            seq = self.waiting[0]
            pages = self.cache.pages_for(len(seq.prompt_token_ids) + seq.params.max_tokens)
            if pages > self.cache.free_pages:
                break
            self.waiting.popleft()
            seq.slot, seq.pages = self.slots.allocate(), self.cache.allocate(pages)
            self.running.append(seq)
            admitted.append((seq, len(seq.prompt_token_ids)))
        if admitted:
            return admitted
        return [(seq, 1) for seq in self.running]

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.slots.release(seq.slot)
        self.cache.release(seq.pages)
        seq.slot, seq.pages = None, []
