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
        """Logits for the last new token of each request (or every new token with `all_rows`)."""
        device = self.model.device
        tokens: list[int] = []
        spans: list[SeqSpan] = []
        for seq, new in scheduled:
            spans.append(SeqSpan(len(tokens), new, seq.cached, seq.slot,
                                 torch.tensor(seq.pages, dtype=torch.long, device=device)))
            tokens.extend(seq.token_ids[seq.cached:seq.cached + new])
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=device), spans)
        rows = (torch.arange(len(tokens), device=device) if all_rows
                else torch.tensor([s.offset + s.new - 1 for s in spans], device=device))
        logits = self.model.forward(batch, self.slots, self.cache, rows, layer_outputs)
        for seq, new in scheduled:
            seq.cached += new
        return logits
