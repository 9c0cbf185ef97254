"""Host RAM for expert banks: exact size, on 2 MiB pages where the kernel gives them, pinned once.

torch's pinned allocator rounds every block up to a power of two (a 1.3 GB bank takes 2 GB of pinned
RAM, which is never swapped out) and keeps freed blocks cached. Host banks are the largest thing the
host holds, so they are mapped here directly: an anonymous mapping aligned to and advised for
transparent huge pages (CPU threads streaming an expert then miss the TLB once per 2 MiB, not once
per 4 KiB), registered with the CUDA driver when a GPU reads it (copies, the PCIe gather kernel), and
unregistered, then unmapped, once the last tensor over it is gone.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref

import torch

HUGE_PAGE = 2 << 20
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MADV_HUGEPAGE = 14
_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def host_empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A zero-filled host tensor of exactly `shape` (pinned if `pin`); small ones come from torch."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or sys.platform != "linux":  # small, or no mmap flags to match
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)
    libc = _libc()
    mapped = nbytes + HUGE_PAGE  # room to start on a huge-page boundary
    base = libc.mmap(None, mapped, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(f"host bank of {nbytes} bytes: mmap failed (errno {ctypes.get_errno()})")
    start = (base + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    libc.madvise(start, nbytes, _MADV_HUGEPAGE)  # advice only: without THP the pages stay 4 KiB
    registered = False
    region = (ctypes.c_uint8 * nbytes).from_address(start)
    try:
        if pin:
            # Fault the pages in on torch's threads first: registering unpopulated memory faults and zeroes it
            # page by page on this one thread, seconds for a release-size bank before any read can land there.
            torch.frombuffer(region, dtype=torch.uint8).zero_()
            status = torch.cuda.cudart().cudaHostRegister(start, nbytes, _REGISTER_PORTABLE_MAPPED)
            if int(status) != 0:
                raise MemoryError(f"host bank of {nbytes} bytes: cudaHostRegister failed ({status})")
            registered = True
    except BaseException:
        _release(libc, base, mapped, start, registered)
        raise
    weakref.finalize(region, _release, libc, base, mapped, start, registered)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # keeps `region` alive


def _release(libc: ctypes.CDLL, base: int, mapped: int, start: int, registered: bool) -> None:
    if registered:
        torch.cuda.cudart().cudaHostUnregister(start)
    libc.munmap(base, mapped)


def host_copy(t: torch.Tensor, pin: bool = False, spare_rows: int = 0) -> torch.Tensor:
    """`t` copied into a host bank buffer of its shape, followed by `spare_rows` zero rows."""
    out = host_empty((t.shape[0] + spare_rows, *t.shape[1:]), t.dtype, pin)
    out[:t.shape[0]].copy_(t)
    return out
