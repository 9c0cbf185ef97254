"""Decode steps replayed from CUDA graphs captured once per batch size at load.

A decode step launches hundreds of small kernels; replaying a captured graph removes the host
from the step (no Python, no launch gaps). Each size in `sizes` gets one graph over static
input tensors; a step of n requests runs the smallest graph that holds n, with the extra rows
pointed at the scratch slot and scratch page so they never touch a real request's state.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.glm5_next import Glm5NextModel

DEFAULT_SIZES = (1, 2, 4, 8, 16)


class DecodeGraphs:
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES, before_replay: Callable[[int], None] | None = None) -> None:
        dev = model.device
        self.before_replay = before_replay
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        self._scratch = (slots.scratch_slot, cache.scratch_page)
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.slot_ids = torch.full((self.max_batch,), slots.scratch_slot, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.page_table = torch.full((self.max_batch, max_pages), cache.scratch_page, dtype=torch.long, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._capture(model, slots, cache, size, pool)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - start

    def _capture(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, size: int, pool) -> None:
        meta = DecodeMeta(self.slot_ids[:size], self.positions[:size], self.page_table[:size])
        batch = ForwardBatch(self.tokens[:size], [], meta)
        # The graph reads these rows' memory at every replay: keep the tensor alive as long as the graph.
        rows = self._rows[size] = torch.arange(size, device=self.tokens.device)
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            for _ in range(2):
                model.forward(batch, slots, cache, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work other threads do meanwhile (a prepared snapshot written after ready, a
        # capture deferred until experts are loaded while requests run) neither breaks nor is broken by it.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._logits[size] = model.forward(batch, slots, cache, rows)
        self._graphs[size] = graph

    def run(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
            page_table: torch.Tensor) -> torch.Tensor:
        """Inputs on the host ([n], [n], [n], [n, max_pages]) -> fp32 logits [n, vocab] on the device."""
        n = tokens.shape[0]
        size = next(s for s in self.sizes if s >= n)
        scratch_slot, scratch_page = self._scratch
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.slot_ids[:n].copy_(slot_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.page_table[:n].copy_(page_table, non_blocking=True)
        if size > n:
            self.slot_ids[n:size].fill_(scratch_slot)
            self.positions[n:size].zero_()
            self.page_table[n:size].fill_(scratch_page)
        if self.before_replay is not None:
            self.before_replay(n)
        self._graphs[size].replay()
        return self._logits[size][:n]
