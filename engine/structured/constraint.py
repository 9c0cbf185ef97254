"""One request's token constraint: an optional reasoning phase, then an optional grammar.

Masks are int32 bitmasks, bit `t % 32` of word `t // 32` set when token `t` is allowed (llguidance's
layout). While the output is still reasoning nothing is constrained, except that a request whose
answer must follow a grammar may not stop there (its stop tokens are masked: a reasoning-only
output has no answer), and that once the reasoning budget is spent only the end token is allowed.
After the end token the grammar's matcher decides, and a complete grammar allows only the stop
(eos) tokens, so the request ends by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import llguidance
import torch

from engine.structured.spec import Reasoning

log = logging.getLogger("glmflash.engine")


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V / 32)] bitmask."""
    words = mask_words(allowed.numel())
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:allowed.numel()] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # two's complement


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether a packed bitmask allows `token`."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def token_mask(vocab_size: int, tokens: Iterable[int], allowed: bool) -> torch.Tensor:
    """A bitmask allowing only `tokens` (allowed=True) or everything but them (allowed=False)."""
    bits = torch.full((vocab_size,), not allowed)
    bits[list(tokens)] = allowed
    return pack_mask(bits)


class RequestConstraint:
    """Which tokens one request may sample next; `accept` every token it samples, in order."""

    def __init__(self, request_id: str, vocab_size: int, matcher: llguidance.LLMatcher | None,
                 reasoning: Reasoning | None, stop_token_ids: Iterable[int]) -> None:
        self.request_id, self.matcher, self.reasoning = request_id, matcher, reasoning
        self.in_reasoning = reasoning is not None
        self.reasoning_tokens = 0
        if reasoning is not None:
            self._end_only = token_mask(vocab_size, [reasoning.end_token_id], allowed=True)
            self._no_stop = token_mask(vocab_size, stop_token_ids, allowed=False) if matcher is not None else None

    @property
    def budget_spent(self) -> bool:
        budget = self.reasoning.budget if self.reasoning is not None else None
        return budget is not None and self.reasoning_tokens >= budget

    @property
    def active(self) -> bool:
        """Whether the next token is constrained at all (a free row keeps the sampler's fast path)."""
        if self.in_reasoning:
            return self.matcher is not None or self.budget_spent
        return self.matcher is not None

    @property
    def fixed_mask(self) -> torch.Tensor | None:
        """The reasoning phase's mask (None once the matcher computes it)."""
        if not self.in_reasoning:
            return None
        return self._reasoning_mask(self.reasoning_tokens)

    def _reasoning_mask(self, reasoning_tokens: int) -> torch.Tensor | None:
        """The reasoning phase's mask after that many reasoning tokens (None: free)."""
        budget = self.reasoning.budget
        return self._end_only if budget is not None and reasoning_tokens >= budget else self._no_stop

    def draft_rows(self, drafts: tuple[int, ...]) -> tuple[list[torch.Tensor | None], int | None]:
        """The masks of a verify's rows: row i masks the token after drafts[:i] were taken. -> (the first rows'
        fixed reasoning masks, None where free; the row from which the matcher's masks follow, drafts[row:]
        taken along, or None). Rows after a draft its row disallows are never verified: left out (free)."""
        fixed: list[torch.Tensor | None] = []
        in_reasoning, count = self.in_reasoning, self.reasoning_tokens
        for row in range(len(drafts) + 1):
            if not in_reasoning:
                return fixed, row if self.matcher is not None else None
            mask = self._reasoning_mask(count)
            fixed.append(mask)
            if row == len(drafts) or (mask is not None and not allows(mask, drafts[row])):
                break
            count += 1
            in_reasoning = drafts[row] != self.reasoning.end_token_id
        return fixed, None

    def accept(self, token: int) -> None:
        if self.in_reasoning:
            self.reasoning_tokens += 1
            self.in_reasoning = token != self.reasoning.end_token_id
        elif self.matcher is not None and not self.matcher.consume_token(token):
            # Only a token outside the mask gets here; the matcher then allows only eos.
            log.error("event=grammar_rejected_token request=%s token=%d error=%r", self.request_id, token,
                      self.matcher.get_error().splitlines()[0])
