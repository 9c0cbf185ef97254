"""A MoE layer's whole host bank copied to the device for a prefill-sized batch, the next layer's copy queued as
soon as this layer's routed math has read the buffer.

A prefill chunk routes its tokens to nearly every expert of a layer (2,048 tokens x 8 pairs over 288 experts: ~57
pairs an expert, so the chance one goes untouched is ~e^-57): the layer's missed experts are its whole host bank.
So the bank crosses the link in one bulk copy per tensor (at the link's rate, not one transfer per expert), and,
since the next layer of the same step needs its whole bank too, that copy need not wait for the next layer's
router: it runs on a copy stream while the device computes the rest of this layer and the next layer's mixer,
resident experts and shared expert; the next layer's missed pairs then run at once. The link and the math overlap
across layers instead of each layer waiting for its own copies.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.weights import Weight, map_tensors, tensor_fields

Stacks = tuple[Weight, Weight, Weight]


def copy_bank(dst: Stacks, src: Stacks) -> None:
    """dst[·][:entries] = src[·] for gate, up and down (asynchronously from pinned host memory)."""
    for dst_stack, src_stack in zip(dst, src):
        for name in tensor_fields(dst_stack):
            source = getattr(src_stack, name)
            getattr(dst_stack, name)[:source.shape[0]].copy_(source, non_blocking=True)


class BankPrefetch:
    """One device buffer the size of the largest host bank, and the layer whose bank it holds or is receiving."""

    def __init__(self, template: Stacks, entries: int, device: torch.device, make_executor: Callable) -> None:
        """template: one layer's host bank (every MoE layer's has the same formats and expert shapes)."""
        self.buffer = tuple(map_tensors(s, lambda t: torch.zeros((entries, *t.shape[1:]), dtype=t.dtype,
                                                                   device=device)) for s in template)
        self.run = make_executor({0: self.buffer})
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.held: int | None = None  # the layer whose bank the buffer holds, or will once its copy is done
        self.loads = 0  # banks copied (prefetched or not)
        self.prefetched = 0  # calls that found their bank copied or on its way before they asked
        self._ready: torch.cuda.Event | None = None  # the held bank's copy
        self._read: torch.cuda.Event | None = None  # the device's last read of the buffer

    def load(self, layer: int, host: Stacks) -> None:
        """Queue the copy of `layer`'s host bank into the buffer, after the device's last read of it."""
        self.held, self.loads = layer, self.loads + 1
        if self.copy_stream is None:
            copy_bank(self.buffer, host)
            return
        if self._read is not None:
            self.copy_stream.wait_event(self._read)
        with torch.cuda.stream(self.copy_stream):
            copy_bank(self.buffer, host)
            self._ready = self.copy_stream.record_event()

    def forget(self) -> None:
        """The host banks changed (a swap committed): what the buffer holds is no layer's bank any more."""
        self.held = None

    def __call__(self, layer: int, host: Stacks, x: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Pairs (x row, host bank entry of `layer`, routing weight), one per entry of rows/entries/weights, run
        on the device from the buffer -> [len(rows), D]."""
        if self.held == layer:
            self.prefetched += 1
        else:
            self.load(layer, host)
        compute = torch.cuda.current_stream(x.device) if self.copy_stream is not None else None
        if compute is not None:
            compute.wait_event(self._ready)
        out = self.run(0, x[rows], entries.unsqueeze(1), weights.unsqueeze(1))
        if compute is not None:
            self._read = compute.record_event()
        return out
