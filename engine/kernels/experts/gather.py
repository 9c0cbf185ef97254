"""Stack rows gathered by entry numbers held on the device: dst[s] = src[entries[s]] where entries[s] >= 0.

Hybrid decode uses it to bring some missed experts from the pinned host bank to device staging slots:
the Triton kernel reads the host memory directly over PCIe (a pinned tensor is addressable from the
device), and because the entries are read on the device, no host decision sits between the router and
the copy: the copy is part of a captured CUDA graph, where a memcpy node would fix its source at
capture. The torch version is the reference (and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import register

BLOCK = 4096  # words per program: 16 KiB in flight per program over the link


@triton.jit
def _gather_kernel(src_ptr, entries_ptr, dst_ptr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    entry = tl.load(entries_ptr + slot)
    if entry >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < WORDS
        words = tl.load(src_ptr + entry.to(tl.int64) * WORDS + offs, mask=mask)
        tl.store(dst_ptr + slot.to(tl.int64) * WORDS + offs, words, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous stack as rows of 4-byte words where the row size allows, else bytes."""
    rows = t.view(t.shape[0], -1).view(torch.uint8)
    return rows.view(torch.int32) if rows.shape[1] % 4 == 0 else rows


def _check(dst: torch.Tensor, src: torch.Tensor, entries: torch.Tensor) -> None:
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype or entries.shape != (dst.shape[0],):
        raise ValueError(f"gather_rows: src {src.dtype} {tuple(src.shape)}, dst {dst.dtype} {tuple(dst.shape)}, "
                         f"entries {tuple(entries.shape)}")


@register("gather_rows", "triton")
def gather_rows_triton(dst: torch.Tensor, src: torch.Tensor, entries: torch.Tensor) -> None:
    _check(dst, src, entries)
    s, d = _words(src.contiguous()), _words(dst)
    words = s.shape[1]
    block = min(BLOCK, triton.next_power_of_2(words))
    _gather_kernel[(d.shape[0], triton.cdiv(words, block))](s, entries, d, WORDS=words, BLOCK=block)


@register("gather_rows", "torch")
def gather_rows_torch(dst: torch.Tensor, src: torch.Tensor, entries: torch.Tensor) -> None:
    _check(dst, src, entries)
    s, d = _words(src.contiguous()), _words(dst)
    rows = s[entries.clamp(min=0).to(s.device)].to(d.device)
    d.copy_(torch.where((entries >= 0).to(d.device)[:, None], rows, d))
