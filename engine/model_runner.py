"""Tensors in, logits out: turns a scheduled step into a ForwardBatch and runs the model.

A step where every request adds one token takes the static decode path (DecodeMeta), replayed
from a CUDA graph when one was captured for a batch that large; any other step runs eagerly with
per-request spans. A request that asks for its prompt's logprobs gets them from the rows of its
prefill chunks, as they run.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.cache.state_rows import StepSaves
from engine.decode_graphs import DecodeGraphs
from engine.model.batch import DecodeMeta, ForwardBatch, SeqSpan
from engine.model.glm5_next import Glm5NextModel
from engine.sampler import token_logprobs
from engine.scheduler import Scheduled
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, max_pages: int) -> None:
        self.model, self.slots, self.cache, self.max_pages = model, slots, cache, max_pages
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, sizes: tuple[int, ...], before_replay: Callable[[int], None] | None = None) -> float:
        """Capture decode graphs at these batch sizes; returns the seconds it took. `before_replay(rows)` is
        told the rows in use before each replay (host work inside the graph skips the padding rows)."""
        self.graphs = DecodeGraphs(self.model, self.slots, self.cache, self.max_pages, sizes, before_replay)
        return self.graphs.capture_s

    def run(self, scheduled: Scheduled, all_rows: bool = False, layer_outputs: list[torch.Tensor] | None = None,
            saves: StepSaves | None = None) -> torch.Tensor:
        """Logits for the last token of each span that reaches its request's end (one row per such span,
        in order), or for every token with `all_rows`. A prefill chunk that stops short needs no logits.
        `saves`: requests whose chunk runs through their prompt's last token as a one-token row, their state
        saved before it."""
        if not all_rows and layer_outputs is None and all(new == 1 == seq.pending for seq, new in scheduled):
            logits = self._decode(scheduled)
        else:
            logits = self._spans(scheduled, all_rows, layer_outputs, saves)
        for seq, new in scheduled:
            seq.cached += new
        return logits

    def _decode(self, scheduled: Scheduled) -> torch.Tensor:
        seqs = [seq for seq, _ in scheduled]
        tokens = torch.tensor([seq.token_ids[seq.cached] for seq in seqs])
        return self._decode_step(tokens, *self._decode_rows([(seq, seq.cached) for seq in seqs]))

    def _decode_rows(self, rows: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host tensors (slots, positions, page table padded with the scratch page) of requests adding one
        token each, at these positions."""
        seqs = [seq for seq, _ in rows]
        slot_ids = torch.tensor([seq.slot for seq in seqs])
        positions = torch.tensor([position for _, position in rows])
        page_table = torch.full((len(seqs), self.max_pages), self.cache.scratch_page, dtype=torch.long)
        for row, seq in enumerate(seqs):
            page_table[row, :len(seq.pages)] = torch.tensor(seq.pages)
        return slot_ids, positions, page_table

    def _decode_meta(self, slot_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor) -> DecodeMeta:
        dev = self.model.device
        return DecodeMeta(slot_ids.to(dev), positions.to(dev), page_table.to(dev))

    def _decode_step(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                     page_table: torch.Tensor) -> torch.Tensor:
        """One decode step from host tensors: replayed from a graph that holds the batch, else eager."""
        if self.graphs is not None and tokens.shape[0] <= self.graphs.max_batch:
            return self.graphs.run(tokens, slot_ids, positions, page_table)
        dev = self.model.device
        batch = ForwardBatch(tokens.to(dev), [], self._decode_meta(slot_ids, positions, page_table))
        return self.model.forward(batch, self.slots, self.cache, torch.arange(tokens.shape[0], device=dev))

    def time_decode(self, steps: int, vocab_size: int, seed: int = 0) -> float:
        """Median seconds of a batch-1 decode step, as requests run it (graph or eager), on the scratch slot
        and page that no request owns; a different random token each step, so routing varies as in text.
        After one untimed step."""
        g = torch.Generator().manual_seed(seed)
        slot_ids, positions = torch.tensor([self.slots.scratch_slot]), torch.zeros(1, dtype=torch.long)
        page_table = torch.full((1, self.max_pages), self.cache.scratch_page, dtype=torch.long)
        times = []
        for _ in range(steps + 1):
            tokens = torch.randint(vocab_size, (1,), generator=g)
            start = time.perf_counter()
            self._decode_step(tokens, slot_ids, positions, page_table).cpu()  # waits for the device
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[steps // 2]

    def _spans(self, scheduled: Scheduled, all_rows: bool, layer_outputs: list[torch.Tensor] | None,
               saves: StepSaves | None) -> torch.Tensor:
        device = self.model.device
        tokens: list[int] = []
        spans: list[SeqSpan] = []
        single: list[tuple[Sequence, int]] = []  # one-token spans: (request, position)
        rows: list[int] = []
        sampled: list[int] = []  # which of `rows` the step samples from
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, its first row in `rows`, rows)
        for seq, new in scheduled:
            parts = [new - 1, 1] if saves is not None and seq in saves.requests else [new]
            for offset, part in zip((0, new - 1), parts):
                spans.append(SeqSpan(len(tokens) + offset, part, seq.cached + offset, seq.slot, seq.pages))
                if part == 1:
                    single.append((seq, seq.cached + offset))
            start = len(tokens)
            tokens.extend(seq.token_ids[seq.cached:seq.cached + new])
            if all_rows:
                rows.extend(range(start, start + new))
                continue
            if seq.params.prompt_logprobs is not None:  # positions whose next token is a prompt token
                count = min(seq.cached + new, len(seq.prompt_token_ids) - 1) - seq.cached
                if count > 0:
                    prompt_rows.append((seq, len(rows), count))
                    rows.extend(range(start, start + count))
            if seq.cached + new == seq.num_tokens:
                sampled.append(len(rows))
                rows.append(start + new - 1)
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=device), spans,
                             single=self._decode_meta(*self._decode_rows(single)) if single else None, saves=saves)
        logits = self.model.forward(batch, self.slots, self.cache, torch.tensor(rows, dtype=torch.long, device=device),
                                    layer_outputs)
        if not prompt_rows:
            return logits
        for seq, first, count in prompt_rows:
            _record_prompt_logprobs(seq, logits[first:first + count])
        return logits[torch.tensor(sampled, dtype=torch.long, device=device)]


def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """Logits of the rows at positions seq.cached.. -> the logprobs of the prompt tokens after them (the
    scheduler keeps such a request's chunks to PROMPT_LOGPROB_CHUNK rows)."""
    targets = seq.prompt_token_ids[seq.cached + 1:seq.cached + 1 + logits.shape[0]]
    seq.prompt_logprobs.extend(token_logprobs(logits, targets, seq.params.prompt_logprobs))
