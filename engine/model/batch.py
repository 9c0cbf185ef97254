"""What one forward step runs: a flat token batch cut into per-request spans (no padding)."""

from __future__ import annotations

from dataclasses import dataclass

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
class ForwardBatch:
    token_ids: torch.Tensor  # [T] flat over spans
    spans: list[SeqSpan]

    @property
    def single_token(self) -> list[int]:
        """Spans that add one token: run through the batched recurrent decode path."""
        return [i for i, s in enumerate(self.spans) if s.new == 1]

    @property
    def multi_token(self) -> list[int]:
        return [i for i, s in enumerate(self.spans) if s.new > 1]
