"""Host bank memory: exact size, huge-page advised, zeroed, and unmapped once its last view is gone."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.offload.host_memory import HUGE_PAGE, host_copy, host_empty


def _mapping_flags(address: int) -> list[str] | None:
    """VmFlags of the mapping holding `address` in this process, None if none does."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_a_large_bank_is_exact_aligned_zeroed_and_advised_for_huge_pages():
    t = host_empty((3, 1000, 1024), torch.bfloat16)
    assert t.shape == (3, 1000, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 3 * 1000 * 1024 * 2  # not rounded up to a power of two
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    flags = _mapping_flags(t.data_ptr())
    assert flags is not None and "hg" in flags


def test_the_mapping_lives_while_a_view_does_and_goes_after():
    t = host_empty((4, HUGE_PAGE), torch.uint8)
    address = t.data_ptr()
    t[2].fill_(7)
    view = t[2:3]
    del t
    gc.collect()
    assert _mapping_flags(address) is not None and int(view.sum()) == 7 * HUGE_PAGE
    del view
    gc.collect()
    assert _mapping_flags(address) is None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.float32, torch.int64])
def test_a_copy_keeps_every_byte(dtype):
    src = torch.randint(0, 256, (5, 3 << 20), dtype=torch.uint8).view(dtype)
    out = host_copy(src)
    assert out.dtype == dtype and out.shape == src.shape
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


def test_a_copy_with_spare_rows_ends_in_zeros():
    """A host bank with room for swaps: the experts, then spare entries that hold nothing."""
    src = torch.randint(1, 256, (4, 3 << 20), dtype=torch.uint8)
    out = host_copy(src, spare_rows=2)
    assert out.shape == (6, 3 << 20) and torch.equal(out[:4], src) and not out[4:].any()


def test_a_small_buffer_comes_from_torch():
    t = host_empty((2, 3), torch.float32)
    assert t.shape == (2, 3) and not t.any()
