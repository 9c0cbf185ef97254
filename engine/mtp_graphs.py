"""The MTP layer's steps replayed from CUDA graphs, one per decode and verify shape of the main model's.

Drafting runs the MTP layer after every step (over the step's rows, then once more for each further draft): run
eagerly it launches as many kernels as a decoder layer and the shared head, about the cost of the whole decode
step's replay in host time. Each graph runs the layer over static inputs (the main model's hidden at each row,
the token after it, the rows' slots, positions and pages) and takes every row's greedy draft (the argmax of the
shared head's logits, whose cost is the head's weight read at any row count up to VERIFY_ROWS), so a step's drafting
is one replay a draft position and one copy of the drafts to the host.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.decode_graphs import Shape, ShapeGraphs, StaticRows
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.mtp import MtpLayer


class MtpGraphs(ShapeGraphs):
    def __init__(self, layer: MtpLayer, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 shapes: list[Shape], pool, before_replay: Callable[[int], None] | None = None) -> None:
        """`shapes`: (requests, tokens a request), the main model's graphs' (`pool`: theirs, as they run one at a
        time with these); `before_replay(rows)`: as for the main model's graphs (hybrid offload's host rows)."""
        dev = layer.embed.device
        rows = max(size * n for size, n in shapes)
        super().__init__(shapes, StaticRows(rows, max_pages, slots.scratch_slot, cache.scratch_page, dev), pool,
                         before_replay)
        self.hidden = torch.zeros(rows, layer.embed.shape[1], dtype=layer.embed.dtype, device=dev)

        def step_of(shape: Shape, batch: ForwardBatch) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
            hidden = self.hidden[:shape[0] * shape[1]]

            def step() -> tuple[torch.Tensor, torch.Tensor]:  # (z, each row's draft)
                z = layer(hidden, batch, slots, cache)
                return z, layer.logits(z).argmax(dim=-1)

            return step

        self._capture_all(step_of)

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, meta: DecodeMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over rows (hidden [R, D] and the tokens after them [R], device tensors, at `meta`'s slots,
        positions and pages) -> its output z [R, D] and each row's greedy draft [R] (valid until the next replay)."""
        self.hidden[:tokens.shape[0]].copy_(hidden)
        z, drafts = self._replay(tokens, meta.slots, meta.positions, meta.page_table, meta.per_request)
        return z, drafts
