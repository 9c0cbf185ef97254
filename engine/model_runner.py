"""Tensors in, logits out: turns a scheduled step into a ForwardBatch and runs the model."""

from __future__ import annotations

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.model.batch import ForwardBatch, SeqSpan
from engine.model.glm5_next import Glm5NextModel
from engine.scheduler import Scheduled


class ModelRunner:
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents) -> None:
        self.model, self.slots, self.cache = model, slots, cache

    def run(self, scheduled: Scheduled, all_rows: bool = False,
            layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits for the last token of each span that reaches its request's end (one row per such span,
        in order), or for every token with `all_rows`. A prefill chunk that stops short needs no logits."""
        device = self.model.device
        tokens: list[int] = []
        spans: list[SeqSpan] = []
        rows: list[int] = []
        for seq, new in scheduled:
            spans.append(SeqSpan(len(tokens), new, seq.cached, seq.slot,
                                 torch.tensor(seq.pages, dtype=torch.long, device=device)))
            tokens.extend(seq.token_ids[seq.cached:seq.cached + new])
            if all_rows:
                rows.extend(range(len(tokens) - new, len(tokens)))
            elif seq.cached + new == seq.num_tokens:
                rows.append(len(tokens) - 1)
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=device), spans)
        logits = self.model.forward(batch, self.slots, self.cache, torch.tensor(rows, dtype=torch.long, device=device),
                                    layer_outputs)
        for seq, new in scheduled:
            seq.cached += new
        return logits
