"""The MTP layer's steps replayed from CUDA graphs, one per decode and verify shape of the main model's.

Drafting runs the MTP layer after every step (over the step's rows, then once more for each further draft): run
eagerly it launches as many kernels as a decoder layer and the shared head, about the cost of the whole decode
step's replay in host time. Each graph runs the layer over static inputs (the main model's hidden at each row,
the token after it, the rows' slots, positions and pages) and takes every row's greedy draft (the argmax of the
shared head's logits, whose cost is the head's weight read at any row count up to VERIFY_ROWS), so a step's drafting
is one replay a draft position and one copy of the drafts to the host.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.decode_graphs import Shape, StaticRows, capture, smallest_holding
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.mtp import MtpLayer


class MtpGraphs:
    def __init__(self, layer: MtpLayer, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 shapes: list[Shape], pool, before_replay: Callable[[int], None] | None = None) -> None:
        """`shapes`: (requests, tokens a request), the main model's graphs' (`pool`: theirs, as they run one at a
        time with these); `before_replay(rows)`: as for the main model's graphs (hybrid offload's host rows)."""
        dev = layer.embed.device
        self.layer, self.shapes, self.before_replay = layer, shapes, before_replay
        rows = max(size * n for size, n in shapes)
        self.inputs = StaticRows(rows, max_pages, slots.scratch_slot, cache.scratch_page, dev)
        self.hidden = torch.zeros(rows, layer.embed.shape[1], dtype=layer.embed.dtype, device=dev)
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Shape, tuple[torch.Tensor, torch.Tensor]] = {}  # (z, each row's draft)
        self._batches: dict[Shape, ForwardBatch] = {}  # read by its graph at every replay: kept as long
        self.replays = {shape: 0 for shape in shapes}
        start = time.perf_counter()
        for shape in sorted(shapes, key=lambda s: -s[0] * s[1]):
            self._capture(slots, cache, shape, pool)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - start

    def _capture(self, slots: RequestSlots, cache: PagedLatents, shape: Shape, pool) -> None:
        size, n = shape
        batch = ForwardBatch(self.inputs.tokens[:size * n], [], self.inputs.meta(size, n))
        hidden = self.hidden[:size * n]
        self._batches[shape] = batch

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            z = self.layer(hidden, batch, slots, cache)
            return z, self.layer.logits(z).argmax(dim=-1)

        self._graphs[shape], self._outputs[shape] = capture(step, pool, hidden.device)

    def holds(self, meta: DecodeMeta) -> bool:
        """Whether a graph runs a step of these rows."""
        return smallest_holding(self.shapes, meta.request_slots.shape[0], meta.per_request) is not None

    def run(self, hidden: torch.Tensor, tokens: torch.Tensor, meta: DecodeMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over rows (hidden [R, D] and the tokens after them [R], device tensors, at `meta`'s slots,
        positions and pages) -> its output z [R, D] and each row's greedy draft [R] (valid until the next replay)."""
        rows, n = tokens.shape[0], meta.per_request
        shape = smallest_holding(self.shapes, rows // n, n)
        self.inputs.fill(shape, tokens, meta.slots, meta.positions, meta.page_table)
        self.hidden[:rows].copy_(hidden)
        if self.before_replay is not None:
            self.before_replay(rows)
        self._graphs[shape].replay()
        self.replays[shape] += 1
        z, drafts = self._outputs[shape]
        return z[:rows], drafts[:rows]
