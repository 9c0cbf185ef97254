"""Tensors in, logits out: turns a step plan into a ForwardBatch and runs the model; it changes no request.

A step where every request adds one token (decode), or every request verifies the same number of drafts after
it, takes the static path (DecodeMeta), replayed from a CUDA graph when one was captured for that shape; any
other step runs eagerly with per-request spans, image tokens taking their image's embeddings (`ImageEmbedder`).
A request that asks for its prompt's logprobs gets them from the rows of its prefill chunks, as they run (in the
step's result).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.decode_graphs import DecodeGraphs
from engine.model.batch import DecodeMeta, ForwardBatch, SeqSpan
from engine.model.glm5_next import Glm5NextModel
from engine.sampler import token_logprobs
from engine.sequence import Sequence, TokenLogprobs
from engine.step_plan import StepPlan, StepResult
from engine.vision.embedder import ImageEmbedder


class ModelRunner:
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 images: ImageEmbedder | None = None) -> None:
        self.model, self.slots, self.cache, self.max_pages = model, slots, cache, max_pages
        self.images = images  # None: a model without a vision tower (requests with images are refused)
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, sizes: tuple[int, ...], before_replay: Callable[[int], None] | None = None,
                       per_request: tuple[int, ...] = (1,)) -> float:
        """Capture decode graphs at these batch sizes, and verify graphs of each `per_request` tokens a request
        (1 + drafts) whose rows fit; returns the seconds it took. `before_replay(rows)` is told the rows in use
        before each replay (host work inside the graph skips the padding rows)."""
        self.graphs = DecodeGraphs(self.model, self.slots, self.cache, self.max_pages, sizes, before_replay,
                                   per_request)
        return self.graphs.capture_s

    def run(self, plan: StepPlan, layer_outputs: list[torch.Tensor] | None = None,
            with_hidden: bool = False) -> StepResult:
        """Logits for the plan's `to_sample` requests (one row each, in order) and then its drafts' rows, or for
        every token with `all_rows`: a prefill chunk that stops short needs none. Requests in `snapshot_saves`
        run their prompt's last token as a one-token row, their state saved before it. `with_hidden`: the result
        carries the batch and every row's collapsed hidden (for the MTP layer)."""
        n = plan.static_tokens if layer_outputs is None else None
        if n is None:
            return self._spans(plan, layer_outputs, with_hidden)
        seqs = [span.seq for span in plan.spans]
        tokens = torch.tensor([token for seq in seqs for token in (*seq.token_ids[seq.num_computed:],
                                                                   *plan.drafts.get(seq, ()))])
        rows = [(seq, seq.num_computed + t) for seq in seqs for t in range(n)]
        logits, hidden, meta = self._static_step(tokens, *self._decode_rows(rows), n, with_hidden)
        if n > 1:  # the sampler's order: each request's last known token's row, then its draft rows
            lasts = [i * n + seq.num_to_compute - 1 for i, seq in enumerate(seqs)]
            order = lasts + [row for last, seq in zip(lasts, seqs) for row in range(last + 1, last + 1 + len(
                plan.drafts.get(seq, ())))]
            logits = logits[torch.tensor(order, device=logits.device)]
        if not with_hidden:
            return StepResult(logits)
        spans = [SeqSpan(i * n, n, seq.num_computed, seq.slot, seq.pages) for i, seq in enumerate(seqs)]
        return StepResult(logits, batch=ForwardBatch(tokens, spans, meta), hidden=hidden)

    def _decode_rows(self, rows: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host tensors (slots, positions, page table padded with the scratch page) of rows of requests' tokens
        at these positions."""
        seqs = [seq for seq, _ in rows]
        slot_ids = torch.tensor([seq.slot for seq in seqs])
        positions = torch.tensor([position for _, position in rows])
        page_table = torch.full((len(seqs), self.max_pages), self.cache.scratch_page, dtype=torch.long)
        for row, seq in enumerate(seqs):
            page_table[row, :len(seq.pages)] = torch.tensor(seq.pages)
        return slot_ids, positions, page_table

    def decode_meta(self, rows: list[tuple[Sequence, int]]) -> DecodeMeta:
        """The device tensors of requests adding one token each, at these positions."""
        return self._decode_meta(*self._decode_rows(rows))

    def _decode_meta(self, slot_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                     n: int = 1) -> DecodeMeta:
        dev = self.model.device
        return DecodeMeta(slot_ids.to(dev), positions.to(dev), page_table.to(dev), n,
                          slot_ids[::n].to(dev) if n > 1 else None)

    def _static_step(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                     page_table: torch.Tensor, n: int = 1, with_hidden: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None, DecodeMeta]:
        """One step of `n` tokens a request from host tensors: replayed from a graph that holds the batch, else
        eager -> (logits of every row, their collapsed hidden, the step's DecodeMeta)."""
        if self.graphs is not None and self.graphs.holds(tokens.shape[0] // n, n):
            return self.graphs.run(tokens, slot_ids, positions, page_table, n)
        dev = self.model.device
        meta = self._decode_meta(slot_ids, positions, page_table, n)
        hidden: list[torch.Tensor] | None = [] if with_hidden else None
        logits = self.model.forward(ForwardBatch(tokens.to(dev), [], meta), self.slots, self.cache,
                                    torch.arange(tokens.shape[0], device=dev), hidden_out=hidden)
        return logits, hidden[0] if hidden else None, meta

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
            self._static_step(tokens, slot_ids, positions, page_table)[0].cpu()  # waits for the device
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[steps // 2]

    def _spans(self, plan: StepPlan, layer_outputs: list[torch.Tensor] | None, with_hidden: bool) -> StepResult:
        device, saves = self.model.device, plan.snapshot_saves
        tokens: list[int] = []
        spans: list[SeqSpan] = []
        one_token_rows: list[tuple[Sequence, int]] = []  # one-token spans: (request, position)
        rows: list[int] = []
        sampled: list[int] = []  # which of `rows` the step samples from
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, its first row in `rows`, rows)
        with_images: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, tokens, first flat row)
        draft_rows: list[int] = []  # the drafted requests' draft tokens' rows, in span order
        for span in plan.spans:
            seq, new, computed = span.seq, span.num_new, span.seq.num_computed
            draft = list(plan.drafts.get(seq, ()))
            length = new + len(draft)
            parts = [length - 1, 1] if saves is not None and seq in saves.requests else [length]
            for offset, part in zip((0, length - 1), parts):
                spans.append(SeqSpan(len(tokens) + offset, part, computed + offset, seq.slot, seq.pages))
                if part == 1:
                    one_token_rows.append((seq, computed + offset))
            start = len(tokens)
            tokens.extend(seq.token_ids[computed:computed + new] + draft)
            draft_rows.extend(range(start + new, start + new + len(draft)))
            if seq.images:
                with_images.append((seq, computed, new, start))
            if plan.all_rows:
                rows.extend(range(start, start + new))
                continue
            if seq.params.prompt_logprobs is not None:  # positions whose next token is a prompt token
                count = min(computed + new, len(seq.prompt_token_ids) - 1) - computed
                if count > 0:
                    prompt_rows.append((seq, len(rows), count))
                    rows.extend(range(start, start + count))
            if span.samples:
                sampled.append(len(rows))
                rows.append(start + new - 1)
        sampled.extend(range(len(rows), len(rows) + len(draft_rows)))  # after every other row
        rows.extend(draft_rows)
        one_token = self.decode_meta(one_token_rows) if one_token_rows else None
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=device), spans, one_token=one_token,
                             snapshot_saves=saves, embeds=self.images.rows(with_images) if with_images else None)
        hidden: list[torch.Tensor] | None = [] if with_hidden else None
        logits = self.model.forward(batch, self.slots, self.cache, torch.tensor(rows, dtype=torch.long, device=device),
                                    layer_outputs, hidden)
        extra = {"batch": batch, "hidden": hidden[0]} if hidden else {}
        if not prompt_rows:
            return StepResult(logits, **extra)
        scored = {seq: _prompt_logprobs(seq, logits[first:first + count]) for seq, first, count in prompt_rows}
        return StepResult(logits[torch.tensor(sampled, dtype=torch.long, device=device)], scored, **extra)


def _prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> list[TokenLogprobs]:
    """Logits of the rows at positions seq.num_computed.. -> the logprobs of the prompt tokens after them (the
    scheduler keeps such a request's chunks to PROMPT_LOGPROB_CHUNK rows)."""
    targets = seq.prompt_token_ids[seq.num_computed + 1:seq.num_computed + 1 + logits.shape[0]]
    return token_logprobs(logits, targets, seq.params.prompt_logprobs)
