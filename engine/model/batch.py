"""What one forward step runs: a flat token batch cut into per-request spans (no padding)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class SeqSpan:
    """One request's part of the step: `new` tokens at flat offset `offset`, after `cached` tokens."""

    offset: int
    new: int
    cached: int
    slot: int
    page_table: torch.Tensor  # page ids covering at least cached + new tokens

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.new)

    @property
    def total(self) -> int:
        return self.cached + self.new


@dataclass
class DecodeMeta:
    """A step where every request adds one token, described by device tensors of static shape [B].

    The decode path reads only these (never `spans`), so the same step can be captured once in a
    CUDA graph and replayed with new values copied into the tensors.
    """

    slots: torch.Tensor  # [B] int64 request slots
    positions: torch.Tensor  # [B] int64 position of the new token (= tokens already cached)
    page_table: torch.Tensor  # [B, max_pages] int64 page ids, padded with the scratch page


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] flat over spans
    spans: list[SeqSpan]
    decode: DecodeMeta | None = None  # set when every span adds one token: the static decode path

    @property
    def single_token(self) -> list[int]:
        """Spans that add one token: run through the batched recurrent decode path."""
        return [i for i, s in enumerate(self.spans) if s.new == 1]

    @property
    def multi_token(self) -> list[int]:
        return [i for i, s in enumerate(self.spans) if s.new > 1]

    @cached_property
    def decode_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n], slots [n]) of the one-token spans, built once per step for every KDA layer."""
        dev = self.token_ids.device
        single = [self.spans[i] for i in self.single_token]
        return (torch.tensor([s.offset for s in single], device=dev),
                torch.tensor([s.slot for s in single], device=dev))

    @cached_property
    def prefill_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [N], slots [B], cu_seqlens [B+1]) of the multi-token spans, built once per step: every
        KDA layer reuses the same tensors (fla memoises its chunk list by the cu_seqlens tensor)."""
        spans = [self.spans[i] for i in self.multi_token]
        dev = self.token_ids.device
        rows = torch.cat([torch.arange(s.offset, s.offset + s.new) for s in spans]).to(dev)
        slots = torch.tensor([s.slot for s in spans], device=dev)
        cu_seqlens = torch.tensor([0] + [s.new for s in spans]).cumsum(0).to(dev)
        return rows, slots, cu_seqlens
