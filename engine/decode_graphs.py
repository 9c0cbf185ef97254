"""Decode and verify steps replayed from CUDA graphs captured once per shape at load.

A decode step launches hundreds of small kernels; replaying a captured graph removes the host
from the step (no Python, no launch gaps). Each shape (requests, tokens a request) gets one graph
over static input tensors: one token a request at each size in `sizes` (decode), and with drafts
verified, 1 + k tokens a request for each k up to the most, at the sizes whose rows fit VERIFY_ROWS (or
the largest decode's). A step of n requests runs the smallest graph of its tokens a request that holds n, with
the extra requests' rows pointed at the scratch slot and scratch page so they never touch a real
request's state.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.glm5_next import Glm5NextModel

DEFAULT_SIZES = (1, 2, 4, 8, 16)
# The most rows of a verify graph: 128 routed pairs at top-8, what hybrid offload's graph-safe path takes
# (`engine.kernels.experts.DECODE_MAX_PAIRS`), unless the decode graphs already hold more.
VERIFY_ROWS = 16


class DecodeGraphs:
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES, before_replay: Callable[[int], None] | None = None,
                 per_request: tuple[int, ...] = (1,)) -> None:
        dev = model.device
        self.before_replay = before_replay
        self.max_batch = max(sizes)
        rows = max(self.max_batch, VERIFY_ROWS)
        # (requests, tokens a request)
        self.shapes = sorted({(size, n) for n in per_request for size in sizes if size * n <= rows}
                             | {(size, 1) for size in sizes}, key=lambda shape: (shape[1], shape[0]))
        self._scratch = (slots.scratch_slot, cache.scratch_page)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_ids = torch.full((rows,), slots.scratch_slot, dtype=torch.long, device=dev)
        self.request_slots = torch.full((rows,), slots.scratch_slot, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.page_table = torch.full((rows, max_pages), cache.scratch_page, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (logits, hidden)
        # Each graph's batch (its layouts: a verify's span bounds) and rows: the graph reads their memory at
        # every replay, so they live as long as it does.
        self._inputs: dict[tuple[int, int], tuple[ForwardBatch, torch.Tensor]] = {}
        self.replays = {shape: 0 for shape in self.shapes}  # steps each graph ran
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: -s[0] * s[1]):  # most rows first: the others reuse its pool
            self._capture(model, slots, cache, shape, pool)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - start

    def _meta(self, requests: int, n: int) -> DecodeMeta:
        rows = requests * n
        return DecodeMeta(self.slot_ids[:rows], self.positions[:rows], self.page_table[:rows], n,
                          self.request_slots[:requests] if n > 1 else None)

    def _capture(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, shape: tuple[int, int],
                 pool) -> None:
        size, n = shape
        batch = ForwardBatch(self.tokens[:size * n], [], self._meta(size, n))
        rows = torch.arange(size * n, device=self.tokens.device)
        self._inputs[shape] = batch, rows
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            for _ in range(2):
                model.forward(batch, slots, cache, rows, hidden_out=[])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        hidden: list[torch.Tensor] = []
        # thread_local: CUDA work other threads do meanwhile (a prepared snapshot written after ready, a
        # capture deferred until experts are loaded while requests run) neither breaks nor is broken by it.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = model.forward(batch, slots, cache, rows, hidden_out=hidden)
        self._outputs[shape] = logits, hidden[0]
        self._graphs[shape] = graph

    def holds(self, requests: int, n: int) -> bool:
        """Whether a graph runs `requests` requests of `n` tokens each."""
        return any(m == n and size >= requests for size, m in self.shapes)

    def run(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
            n: int = 1) -> tuple[torch.Tensor, torch.Tensor, DecodeMeta]:
        """Inputs on the host ([R], [R], [R], [R, max_pages]: `n` rows a request, one after another) -> fp32
        logits [R, vocab] and the collapsed hidden [R, hidden] on the device, and the step's DecodeMeta (valid
        until the next replay)."""
        rows = tokens.shape[0]
        requests = rows // n
        size = next(s for s, m in self.shapes if m == n and s >= requests)
        scratch_slot, scratch_page = self._scratch
        self.tokens[:rows].copy_(tokens, non_blocking=True)
        self.slot_ids[:rows].copy_(slot_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.page_table[:rows].copy_(page_table, non_blocking=True)
        if n > 1:
            self.request_slots[:requests].copy_(slot_ids[::n], non_blocking=True)
            self.request_slots[requests:size].fill_(scratch_slot)
        if size > requests:
            self.slot_ids[rows:size * n].fill_(scratch_slot)
            self.positions[rows:size * n].zero_()
            self.page_table[rows:size * n].fill_(scratch_page)
        if self.before_replay is not None:
            self.before_replay(rows)
        self._graphs[(size, n)].replay()
        self.replays[(size, n)] += 1
        logits, hidden = self._outputs[(size, n)]
        return logits[:rows], hidden[:rows], self._meta(requests, n)
