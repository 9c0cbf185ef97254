"""A step as plain data, the contract between its three parts: the scheduler plans it (which requests run how
many tokens, which of them sample a token, which states are saved partway for the prefix cache), the runner
only computes it (`StepResult`: the logits rows, the prompt logprobs it scored), and the scheduler's `update`
is the one place a request advances (tokens computed, the prefix cache recorded, tokens appended, finishes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.cache.state_rows import StepSaves
from engine.model.batch import ForwardBatch
from engine.sequence import Sequence, TokenLogprobs


@dataclass(frozen=True)
class Span:
    seq: Sequence
    num_new: int  # tokens run this step, from seq.num_computed on

    @property
    def samples(self) -> bool:
        """Whether the span reaches its request's last known token, whose logits row samples the next one."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


MAX_STATIC_TOKENS = 4  # rows a request on the static path: its token and up to 3 drafts


def _runs_static(span: Span) -> bool:
    seq = span.seq
    return (span.num_new == seq.num_to_compute and (span.num_new == 1 or seq.params.prompt_logprobs is None)
            and not seq.images_in(seq.num_computed, seq.num_tokens))


@dataclass(frozen=True)
class StepPlan:
    spans: tuple[Span, ...]
    to_sample: tuple[Sequence, ...]  # the requests a logits row each is sampled for, in row order
    snapshot_saves: StepSaves | None = None  # requests whose state is saved before their last token this step
    all_rows: bool = False  # logits for every token run (a prompt scored whole), nothing sampled
    started: float = field(default_factory=time.perf_counter)  # when the step's planning began
    # Decoding requests whose span also runs MTP drafts after their last known token (the verify), and those
    # drafts: a logits row each after the to_sample rows, in span order.
    drafts: dict[Sequence, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, spans: list[tuple[Sequence, int]], snapshot_saves: StepSaves | None = None, all_rows: bool = False,
           started: float | None = None) -> "StepPlan":
        planned = tuple(Span(seq, num_new) for seq, num_new in spans)
        to_sample = () if all_rows else tuple(span.seq for span in planned if span.samples)
        return cls(planned, to_sample, snapshot_saves, all_rows, time.perf_counter() if started is None else started)

    def __bool__(self) -> bool:
        return bool(self.spans)

    @property
    def static_tokens(self) -> int | None:
        """Tokens each request runs on the static path (a CUDA graph where captured): every request runs all its
        unrun tokens and its drafts, the same number n <= MAX_STATIC_TOKENS for each (decode: n = 1; a verify of
        k drafts: 1 + k, or after a rejection its tokens run again and fewer drafts); None for any other step.
        That path reads the embedding table only (an image's tokens are no static step), and no prompt rows."""
        if self.all_rows or self.snapshot_saves is not None:
            return None
        lengths = {span.num_new + len(self.drafts.get(span.seq, ())) for span in self.spans}
        if len(lengths) > 1 or not all(_runs_static(span) for span in self.spans):
            return None
        n = lengths.pop()
        return n if n <= MAX_STATIC_TOKENS else None

    @property
    def drafts_in_order(self) -> list[tuple[Sequence, tuple[int, ...]]]:
        """The drafted requests and their drafts, in the order of their draft rows."""
        return [(span.seq, self.drafts[span.seq]) for span in self.spans if span.seq in self.drafts]

    @property
    def has_prefill(self) -> bool:
        return any(span.num_new > 1 for span in self.spans)


@dataclass
class StepResult:
    logits: torch.Tensor  # one row per plan.to_sample request (every token's row with all_rows)
    # Requests asking for prompt logprobs: those of the prompt tokens their chunk scored this step.
    prompt_logprobs: dict[Sequence, list[TokenLogprobs]] = field(default_factory=dict)
    # With the MTP layer on: the step's batch and every row's collapsed hidden (what the MTP layer runs on).
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None
