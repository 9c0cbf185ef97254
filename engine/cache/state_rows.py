"""Rows of saved request state, on the device or in host RAM: what the prefix cache keeps between requests.

`PageRows` holds copies of cache pages (DSA latents and pooled indexer keys), `StateRows` the state a
request slot holds at one position: the KDA recurrent and short-conv state, the indexer's open pool,
and the page the position falls in (its first tokens are part of the prefix). Copies run on the
current stream (non-blocking into pinned host rows), so saving and restoring never wait for the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from engine.cache.paged_latents import PagedLatents, page_parts
from engine.cache.slots import RequestSlots
from engine.config import ModelConfig


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    # Empty, not zeroed: a row is always written whole before it is read, and on the host untouched
    # rows cost no memory until used.
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


def _state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    h, d, n_kda = cfg.linear_num_heads, cfg.linear_head_dim, len(cfg.kda_layers)
    return ((n_kda, h, d, d), (n_kda, 3 * cfg.linear_dim, cfg.conv_kernel - 1),
            (len(cfg.dsa_layers), cfg.index_kpool, 2 * cfg.index_head_dim))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of one cache page (in fp8: codes and scales)."""
    return sum(_numel(shape) * part_dtype.itemsize for shape, part_dtype in page_parts(cfg, page_size, dtype,
                                                                                         fp8).values())


def state_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of one saved state, its page included (the recurrent state is fp32)."""
    recurrent, conv, open_pool = _state_shapes(cfg)
    return (_numel(recurrent) * 4 + (_numel(conv) + _numel(open_pool)) * dtype.itemsize
            + page_bytes(cfg, page_size, dtype, fp8))


class PageRows:
    """Copies of whole cache pages, a row each: every tensor of a page (`PagedLatents.page_views`)."""

    def __init__(self, cfg: ModelConfig, rows: int, page_size: int, device: torch.device, dtype: torch.dtype,
                 pin: bool = False, fp8: bool = False) -> None:
        self.rows = rows
        self.parts = {name: _empty((rows, *shape), part_dtype, device, pin)
                      for name, (shape, part_dtype) in page_parts(cfg, page_size, dtype, fp8).items()}
        self.latents = self.parts["latents"]

    def save(self, row: int, cache: PagedLatents, page: int) -> None:
        for name, view in cache.page_views(page).items():
            self.parts[name][row].copy_(view, non_blocking=True)

    def load(self, row: int, cache: PagedLatents, page: int) -> None:
        for name, view in cache.page_views(page).items():
            view.copy_(self.parts[name][row], non_blocking=True)

    def copy_row(self, row: int, dst: "PageRows", dst_row: int) -> None:
        for name, part in self.parts.items():
            dst.parts[name][dst_row].copy_(part[row], non_blocking=True)


class StateRows:
    def __init__(self, cfg: ModelConfig, rows: int, page_size: int, device: torch.device, dtype: torch.dtype,
                 pin: bool = False, fp8: bool = False) -> None:
        recurrent, conv, open_pool = _state_shapes(cfg)
        self.rows = rows
        self.recurrent = _empty((rows, *recurrent), torch.float32, device, pin)
        self.conv = _empty((rows, *conv), dtype, device, pin)
        self.open_pool = _empty((rows, *open_pool), dtype, device, pin)
        self.page = PageRows(cfg, rows, page_size, device, dtype, pin, fp8)

    def save(self, row: int, slots: RequestSlots, slot: int, cache: PagedLatents, page: int | None) -> None:
        """Slot state -> row; `page` (the page holding the position's first tokens) too when given."""
        self.recurrent[row].copy_(slots.recurrent[:, slot], non_blocking=True)
        self.conv[row].copy_(slots.conv[:, slot], non_blocking=True)
        self.open_pool[row].copy_(slots.open_pool[:, slot], non_blocking=True)
        if page is not None:
            self.page.save(row, cache, page)

    def load(self, row: int, slots: RequestSlots, slot: int, cache: PagedLatents, page: int | None) -> None:
        """Row -> slot state; the saved page into `page` (the request's own copy) when given."""
        slots.recurrent[:, slot].copy_(self.recurrent[row], non_blocking=True)
        slots.conv[:, slot].copy_(self.conv[row], non_blocking=True)
        slots.open_pool[:, slot].copy_(self.open_pool[row], non_blocking=True)
        if page is not None:
            self.page.load(row, cache, page)

    def copy_row(self, row: int, dst: "StateRows", dst_row: int) -> None:
        dst.recurrent[dst_row].copy_(self.recurrent[row], non_blocking=True)
        dst.conv[dst_row].copy_(self.conv[row], non_blocking=True)
        dst.open_pool[dst_row].copy_(self.open_pool[row], non_blocking=True)
        self.page.copy_row(row, dst.page, dst_row)


@dataclass(frozen=True)
class StepSaves:
    """Request slots whose state a forward step saves partway through, into rows of `store`: each layer copies
    them after the step's multi-token spans and before its one-token rows, so a prompt's last token runs in the
    same step as the rest of its chunk while the state one token before the prompt's end is kept."""

    store: StateRows
    requests: set[Hashable]  # whose spans the step splits before their last token
    slots: torch.Tensor  # [n] their slots, on the device
    rows: torch.Tensor  # [n] and rows of `store`

    def save_kda(self, recurrent: torch.Tensor, conv: torch.Tensor, index: int) -> None:
        """KDA layer `index`'s recurrent and conv state (its slices of RequestSlots)."""
        self.store.recurrent[self.rows, index] = recurrent[self.slots]
        self.store.conv[self.rows, index] = conv[self.slots]

    def save_dsa(self, open_pool: torch.Tensor, index: int) -> None:
        """DSA layer `index`'s open indexer pool (its slice of RequestSlots)."""
        self.store.open_pool[self.rows, index] = open_pool[self.slots]
