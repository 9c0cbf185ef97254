"""Drafts from the checkpoint's MTP layer, kept in step with the main model: after every step it runs over the
step's rows (the main model's collapsed hidden at each position, the token after it: a prompt token, or the one
just sampled), so its own latent cache holds every position the main model computed, and each request that
sampled gets a draft of the token after that one (`Sequence.draft_token`, greedy).

Verification is the next step (issue: speculative decoding); until then the drafts are only counted: how many
were proposed and how many equalled the token the main model sampled next (the acceptance rate that decides
whether speculation pays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.batch import ForwardBatch
from engine.model.mtp import MtpCaches, MtpLayer
from engine.sequence import Sequence
from engine.step_plan import StepPlan, StepResult


@dataclass
class DraftStats:
    proposed: int = 0  # drafts whose position the main model has since sampled
    accepted: int = 0  # of those, drafts equal to the sampled token

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


class MtpDrafter:
    def __init__(self, layer: MtpLayer, caches: MtpCaches) -> None:
        self.layer, self.caches = layer, caches
        self.stats = DraftStats()

    def step(self, plan: StepPlan, result: StepResult) -> None:
        """After the step's requests were updated (sampled tokens appended): score the drafts they had, then run
        the MTP layer over the step's rows and draft anew for the requests that sampled."""
        tokens: list[int] = []
        draft_rows: list[tuple[Sequence, int]] = []
        sampled = set(plan.to_sample)  # (a span's `samples` reads the request as it was before the update)
        for span in plan.spans:
            seq, first = span.seq, len(tokens)
            start = seq.num_computed - span.num_new  # the step ran positions start .. num_computed - 1
            after = seq.token_ids[start + 1:seq.num_computed + 1]  # the token after each
            tokens.extend(after + [0] * (span.num_new - len(after)))  # none after an aborted request's last row
            if seq in sampled:
                self._score(seq)
                draft_rows.append((seq, first + span.num_new - 1))
        main = result.batch
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=main.token_ids.device), main.spans,
                             main.decode, main.one_token)
        rows = torch.tensor([row for _, row in draft_rows], dtype=torch.long, device=main.token_ids.device)
        logits, _ = self.layer(result.hidden, batch, self.caches, rows)
        for (seq, _), token in zip(draft_rows, logits.argmax(dim=-1).tolist()):
            seq.draft_token = token

    def _score(self, seq: Sequence) -> None:
        """The request just sampled its last token: was it the draft?"""
        if seq.draft_token is not None:
            self.stats.proposed += 1
            self.stats.accepted += seq.token_ids[-1] == seq.draft_token
            seq.draft_token = None
