"""Drafts from the checkpoint's MTP layer, kept in step with the main model, and (with `verify`) checked in the
next step: speculative decoding with one draft token.

After every step the MTP layer runs over the step's rows (the main model's collapsed hidden at each position, the
token after it: a prompt token, or the one just sampled), so its own latent cache holds every position the main
model computed, and each request that sampled gets a draft of the token after that one (`Sequence.draft_token`,
greedy).

With `verify`, a request's next decode step runs its token and its draft as one two-token span (the verify): the
token's row gives the next token as without drafts (greedy; sampling accepts the draft with the probability the row
gives it, else draws from the rest: the same distribution, `engine.sampler.verify_drafts`); if that token is the
draft, the draft's row gives one more, so the step yields two tokens for the price of one step's weight reads.
Otherwise the draft's position
has left its traces in the request's recurrent, short-conv and open-pool state (the main model's and the MTP
layer's): those are restored from a copy taken before the step, and the request computes its token again next
step, with the new one (latents past a position are rewritten before anything reads them). Greedy output is the
same token for token as without drafts; sampled output follows the same distribution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.cache.state_rows import StateRows
from engine.config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.mtp import MtpCaches, MtpLayer, mtp_attention_config
from engine.sequence import Sequence
from engine.step_plan import StepPlan, StepResult


@dataclass
class DraftStats:
    proposed: int = 0  # drafts whose position the main model has since sampled
    accepted: int = 0  # of those, drafts equal to the sampled token
    verified: int = 0  # drafts run in a verify step (speculative)
    verified_accepted: int = 0  # of those, accepted: each gave a second token in its step

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step gave a request, on average (1 + its accepted drafts)."""
        return 1 + self.verified_accepted / self.verified if self.verified else None


def verifiable(seq: Sequence) -> bool:
    """A request whose next token depends on its logits row alone (greedy, or temperature / top-k / top-p /
    min-p sampling): its draft can be verified from the rows (`engine.sampler.verify_drafts`)."""
    p = seq.params
    return (not p.logits_processors and not p.penalized and p.logprobs is None and p.prompt_logprobs is None
            and seq.constraint is None)


class MtpDrafter:
    def __init__(self, config: ModelConfig, layer: MtpLayer, slots: RequestSlots, cache: PagedLatents,
                 verify: bool = False) -> None:
        self.layer, self.slots, self.cache, self.verify = layer, slots, cache, verify
        self.caches = MtpCaches.like(config, slots, cache)
        self.stats = DraftStats()
        if verify:  # a copy of each slot's state from before its verify step, main and MTP layer
            device, dtype, rows = cache.latents.device, cache.latents.dtype, slots.num_slots + 1
            self.saved = StateRows(config, rows, cache.page_size, device, dtype)
            self.saved_mtp = StateRows(mtp_attention_config(config), rows, cache.page_size, device, dtype)

    def with_drafts(self, plan: StepPlan) -> StepPlan:
        """The plan with its decoding greedy requests' drafts to verify; their states copied first."""
        if not self.verify or plan.snapshot_saves is not None:
            return plan
        drafted = frozenset(span.seq for span in plan.spans
                            if span.num_new == 1 == span.seq.num_to_compute and span.seq.draft_token is not None
                            and verifiable(span.seq))
        for seq in drafted:
            self.saved.save(seq.slot, self.slots, seq.slot, self.cache, None)
            self.saved_mtp.save(seq.slot, self.caches.slots, seq.slot, self.caches.cache, None)
        return dataclasses.replace(plan, drafted=drafted) if drafted else plan

    def step(self, plan: StepPlan, result: StepResult) -> None:
        """After the step's requests were updated (tokens appended, drafts verified): score the drafts they had,
        run the MTP layer over the step's rows, draft anew for the requests that sampled, and restore the state
        of those whose draft was rejected."""
        main = result.batch
        tokens: list[int] = []
        draft_rows: list[tuple[Sequence, int]] = []
        rejected: list[Sequence] = []
        sampled = set(plan.to_sample)
        for span, part in zip(plan.spans, main.spans, strict=True):  # one part a span: no snapshot splits here
            seq, start = span.seq, part.num_computed
            after = seq.token_ids[start + 1:start + part.new + 1]  # the token after each row
            tokens.extend(after + [0] * (part.new - len(after)))  # none past a request that stopped there
            if seq not in sampled:
                continue
            if seq.draft_token is not None:
                right = seq.token_ids[start + 1] == seq.draft_token
                self.stats.proposed += 1
                self.stats.accepted += right
                if seq in plan.drafted:
                    self.stats.verified += 1
                    self.stats.verified_accepted += right
            seq.draft_token = None
            if seq in plan.drafted and not seq.finished and seq.num_computed == start:
                rejected.append(seq)  # its token runs again next step
            elif not seq.finished:
                draft_rows.append((seq, part.offset + part.new - 1))
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=main.token_ids.device), main.spans,
                             main.decode, main.one_token)
        rows = torch.tensor([row for _, row in draft_rows], dtype=torch.long, device=main.token_ids.device)
        logits, _ = self.layer(result.hidden, batch, self.caches, rows)
        for (seq, _), token in zip(draft_rows, logits.argmax(dim=-1).tolist()):
            seq.draft_token = token
        for seq in rejected:
            self.saved.load(seq.slot, self.slots, seq.slot, self.cache, None)
            self.saved_mtp.load(seq.slot, self.caches.slots, seq.slot, self.caches.cache, None)
