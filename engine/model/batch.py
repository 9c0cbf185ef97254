"""What one forward step runs: a flat token batch cut into per-request spans (no padding)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Hashable, TypeVar

import torch

from engine.cache.state_rows import StepSaves

T = TypeVar("T")


@dataclass
class SeqSpan:
    """One request's part of the step: `new` tokens at flat offset `offset`, after `num_computed` tokens."""

    offset: int
    new: int
    num_computed: int  # the request's tokens before this span (the span's first position)
    slot: int
    pages: list[int]  # page ids covering at least num_computed + new tokens

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.new)

    @property
    def total(self) -> int:
        return self.num_computed + self.new


@dataclass
class DecodeMeta:
    """B requests adding `per_request` tokens each (one: a decode step, or the one-token spans of a mixed step;
    more: a verify of the same number of drafts each), described by device tensors of static shape: one row per
    token, a request's rows one after another.

    The static path reads only these (never `spans`), so the same step can be captured once in a
    CUDA graph and replayed with new values copied into the tensors.
    """

    slots: torch.Tensor  # [R] int64 request slot of each row
    positions: torch.Tensor  # [R] int64 position of the row's token (= tokens already cached before it)
    page_table: torch.Tensor  # [R, max_pages] int64 page ids, padded with the scratch page
    per_request: int = 1
    request_slots: torch.Tensor | None = None  # [B] each request's slot (per_request > 1; else `slots`)

    def __post_init__(self) -> None:
        if self.per_request == 1:
            self.request_slots = self.slots
        elif self.request_slots is None:
            raise ValueError("a multi-token DecodeMeta needs its requests' slots")

    def token(self, t: int) -> "DecodeMeta":
        """The rows of each request's t-th token (views): the one-token steps that state kept per pool or per
        token (the indexer's open pool) takes in order."""
        n = self.per_request
        return DecodeMeta(self.slots[t::n], self.positions[t::n], self.page_table[t::n])


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] flat over spans
    spans: list[SeqSpan]
    decode: DecodeMeta | None = None  # set when every span adds one token: the static decode path
    # A mixed step's one-token spans (decoding requests, a prompt's last token), in span order: they run
    # together through the layers' decode paths, so each adds no launches of its own to the step.
    one_token: DecodeMeta | None = None
    # Requests whose state is saved between the step's multi-token spans and its one-token rows (the prefix
    # cache's snapshot one token before a prompt's end, whose last token is a one-token span of this step).
    snapshot_saves: StepSaves | None = None
    # (rows [n], embeddings [n, hidden]): image tokens' inputs, the tower's output in place of the embedding table's.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    _layouts: dict[Hashable, object] = field(default_factory=dict, init=False, repr=False)

    @property
    def one_token_spans(self) -> list[int]:
        """Spans that add one token: run through the batched decode paths (`one_token`)."""
        return [i for i, s in enumerate(self.spans) if s.new == 1]

    @property
    def multi_token_spans(self) -> list[int]:
        return [i for i, s in enumerate(self.spans) if s.new > 1]

    @cached_property
    def one_token_rows(self) -> torch.Tensor:
        """Rows [n] of the one-token spans (the rows of `one_token`), built once per step for every layer."""
        return torch.tensor([self.spans[i].offset for i in self.one_token_spans], device=self.token_ids.device)

    @cached_property
    def prefill_layout(self) -> tuple[torch.Tensor | slice, torch.Tensor, torch.Tensor]:
        """(rows, slots [B], cu_seqlens [B+1]) of the multi-token spans, built once per step: every
        KDA layer reuses the same tensors (fla memoises its chunk list by the cu_seqlens tensor)."""
        spans = [self.spans[i] for i in self.multi_token_spans]
        dev = self.token_ids.device
        slots = torch.tensor([s.slot for s in spans], device=dev)
        cu_seqlens = torch.tensor([0] + [s.new for s in spans]).cumsum(0).to(dev)
        return self.prefill_rows, slots, cu_seqlens

    @cached_property
    def prefill_rows(self) -> torch.Tensor | slice:
        """The multi-token spans' rows: a slice where they are every row of the step in order (a lone prompt's
        chunk, prompts beside no decoding request), so the layers take views of their activations instead of
        gathering copies ([N, 3P] a KDA layer, [N, 64, 512] a DSA layer); else an index tensor [N]."""
        multi = [self.spans[i] for i in self.multi_token_spans]
        offsets = [0] + [s.offset + s.new for s in multi[:-1]]
        if [s.offset for s in multi] == offsets and sum(s.new for s in multi) == self.token_ids.shape[0]:
            return slice(0, self.token_ids.shape[0])
        return torch.cat([torch.arange(s.offset, s.offset + s.new) for s in multi]).to(self.token_ids.device)

    def layout(self, key: Hashable, build: Callable[[], T]) -> T:
        """A layout of this step that every layer of a kind reads (index tensors built on the host and moved in
        one copy): `build` makes it for the first layer that asks, the others get the same one."""
        if key not in self._layouts:
            self._layouts[key] = build()
        return self._layouts[key]
