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

import logging
import time
from typing import Callable, TypeVar

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.glm5_next import Glm5NextModel

log = logging.getLogger("glmflash.engine")
T = TypeVar("T")
Shape = tuple[int, int]  # (requests, tokens a request)

DEFAULT_SIZES = (1, 2, 4, 8, 16)
# The most rows of a verify graph: 128 routed pairs at top-8, what hybrid offload's graph-safe path takes
# (`engine.kernels.experts.DECODE_MAX_PAIRS`), unless the decode graphs already hold more.
VERIFY_ROWS = 16


def graph_shapes(sizes: tuple[int, ...], per_request: tuple[int, ...]) -> list[Shape]:
    """Decode shapes at every size, and verify shapes (n > 1 tokens a request) whose rows fit, fewest tokens a
    request first, then fewest requests: the first that holds a step is the smallest."""
    rows = max(max(sizes), VERIFY_ROWS)
    shapes = {(size, n) for n in per_request for size in sizes if size * n <= rows} | {(size, 1) for size in sizes}
    return sorted(shapes, key=lambda shape: (shape[1], shape[0]))


def smallest_holding(shapes: list[Shape], requests: int, n: int) -> Shape | None:
    """The smallest shape of `n` tokens a request that holds `requests` requests."""
    return next(((size, m) for size, m in shapes if m == n and size >= requests), None)


class StaticRows:
    """The input tensors a captured step reads at every replay: each row's token, slot, position and page table,
    and each request's slot, sized for the most rows; a replay copies its rows in and points the padding rows
    of the graph's shape at the scratch slot and page."""

    def __init__(self, rows: int, max_pages: int, scratch_slot: int, scratch_page: int, device: torch.device) -> None:
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_ids = torch.full((rows,), scratch_slot, dtype=torch.long, device=device)
        self.request_slots = torch.full((rows,), scratch_slot, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.page_table = torch.full((rows, max_pages), scratch_page, dtype=torch.long, device=device)

    def meta(self, requests: int, n: int) -> DecodeMeta:
        rows = requests * n
        return DecodeMeta(self.slot_ids[:rows], self.positions[:rows], self.page_table[:rows], n,
                          self.request_slots[:requests] if n > 1 else None)

    def fill(self, shape: Shape, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
             page_table: torch.Tensor) -> None:
        """Rows of `n` tokens a request (host or device tensors: [R], [R], [R], [R, max_pages]) into
        the first rows; the rest of `shape`'s rows to the scratch slot and page."""
        size, n = shape
        rows = tokens.shape[0]
        requests = rows // n
        self.tokens[:rows].copy_(tokens, non_blocking=True)
        self.slot_ids[:rows].copy_(slot_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.page_table[:rows].copy_(page_table, non_blocking=True)
        if n > 1:
            self.request_slots[:requests].copy_(slot_ids[::n], non_blocking=True)
            self.request_slots[requests:size].fill_(self.scratch_slot)
        if size > requests:
            self.slot_ids[rows:size * n].fill_(self.scratch_slot)
            self.positions[rows:size * n].zero_()
            self.page_table[rows:size * n].fill_(self.scratch_page)


def capture(step: Callable[[], T], pool, device: torch.device,
            warm_s: list[float] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`step` captured in a CUDA graph (in `pool`) -> the graph and the step's outputs, which each replay rewrites.
    Run twice first on a side stream, so compiling and autotuning happen outside the capture; the seconds those
    runs took are appended to `warm_s` (what a start's first steps pay, apart from recording the graph)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    start = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    if warm_s is not None:
        side.synchronize()
        warm_s.append(time.perf_counter() - start)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA work other threads do meanwhile (a prepared snapshot written after ready, a
    # capture deferred until experts are loaded while requests run) neither breaks nor is broken by it.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = step()
    return graph, outputs


class ShapeGraphs:
    """One CUDA graph of a step per shape, over shared static inputs: captured most rows first (the others reuse
    its memory pool), replayed in the smallest shape that holds a step, with the shape's padding rows on the
    scratch slot and page."""

    def __init__(self, shapes: list[Shape], inputs: StaticRows, pool,
                 before_replay: Callable[[int], None] | None) -> None:
        """`before_replay(rows)` is told the rows in use before each replay (hybrid offload's host work skips the
        padding rows)."""
        self.shapes, self.inputs, self.pool, self.before_replay = shapes, inputs, pool, before_replay
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Shape, tuple[torch.Tensor, ...]] = {}
        # Each shape's step (what it closes over: its batch's layouts, such as a verify's span bounds, and its
        # rows): the graph reads their memory at every replay, so they live as long as it does.
        self._steps: dict[Shape, Callable[[], tuple[torch.Tensor, ...]]] = {}
        self.replays = {shape: 0 for shape in shapes}  # steps each graph ran
        self.capture_s = 0.0

    def _capture_all(self, step_of: Callable[[Shape, ForwardBatch], Callable[[], tuple[torch.Tensor, ...]]]) -> None:
        """Capture `step_of(shape, batch)` for every shape, `batch` the shape's rows of the static inputs."""
        device = self.inputs.tokens.device
        start = time.perf_counter()
        order = sorted(self.shapes, key=lambda s: -s[0] * s[1])
        warm_s: list[float] = []
        for shape in order:
            size, n = shape
            step = self._steps[shape] = step_of(shape, ForwardBatch(self.inputs.tokens[:size * n], [],
                                                                    self.inputs.meta(size, n)))
            self._graphs[shape], self._outputs[shape] = capture(step, self.pool, device, warm_s)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - start
        # where a slow capture goes: the eager runs before each (first launches, compiles), or the recording
        log.info("event=graph_capture shapes=%s warm_s=%s seconds=%.2f", ",".join(f"{r}x{n}" for r, n in order),
                 ",".join(f"{w:.2f}" for w in warm_s), self.capture_s)

    def holds(self, requests: int, n: int) -> bool:
        """Whether a graph runs `requests` requests of `n` tokens each."""
        return smallest_holding(self.shapes, requests, n) is not None

    def _replay(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                page_table: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """The step's rows (`StaticRows.fill`) through the smallest graph that holds them -> its outputs' rows in
        use (valid until the next replay)."""
        rows = tokens.shape[0]
        shape = smallest_holding(self.shapes, rows // n, n)
        self.inputs.fill(shape, tokens, slot_ids, positions, page_table)
        if self.before_replay is not None:
            self.before_replay(rows)
        self._graphs[shape].replay()
        self.replays[shape] += 1
        return tuple(output[:rows] for output in self._outputs[shape])


class DecodeGraphs(ShapeGraphs):
    def __init__(self, model: Glm5NextModel, slots: RequestSlots, cache: PagedLatents, max_pages: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES, before_replay: Callable[[int], None] | None = None,
                 per_request: tuple[int, ...] = (1,)) -> None:
        shapes = graph_shapes(sizes, per_request)
        inputs = StaticRows(max(size * n for size, n in shapes), max_pages, slots.scratch_slot, cache.scratch_page,
                            model.device)
        super().__init__(shapes, inputs, torch.cuda.graph_pool_handle(), before_replay)

        def step_of(shape: Shape, batch: ForwardBatch) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
            rows = torch.arange(shape[0] * shape[1], device=model.device)

            def step() -> tuple[torch.Tensor, torch.Tensor]:  # (logits, hidden)
                hidden: list[torch.Tensor] = []
                logits = model.forward(batch, slots, cache, rows, hidden_out=hidden)
                return logits, hidden[0]

            return step

        self._capture_all(step_of)

    def run(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
            n: int = 1) -> tuple[torch.Tensor, torch.Tensor, DecodeMeta]:
        """Inputs on the host ([R], [R], [R], [R, max_pages]: `n` rows a request, one after another) -> fp32
        logits [R, vocab] and the collapsed hidden [R, hidden] on the device, and the step's DecodeMeta (valid
        until the next replay)."""
        logits, hidden = self._replay(tokens, slot_ids, positions, page_table, n)
        return logits, hidden, self.inputs.meta(tokens.shape[0] // n, n)
