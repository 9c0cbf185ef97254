"""Honest disk figures: files dropped from the page cache, and read back the way a fast loader reads (the disk's rate).

A load figure measured on files the page cache still holds is a memory figure; every benchmark that
reports a load rate evicts the files first (`evict`: fsync, then POSIX_FADV_DONTNEED, which only
drops clean pages) and reports it next to `raw_read` of the same files, evicted again, in the same run.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

PIECE = 64 << 20


def evict(paths: Iterable[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: Iterable[Path], workers: int = 8, piece: int = PIECE) -> tuple[int, float]:
    """(bytes, seconds): every byte of the files by `workers` parallel `piece`-sized preads into reused
    buffers, evicted before and after."""
    paths = list(paths)
    evict(paths)
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, piece)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def read(job: tuple[Path, int]) -> int:
        path, offset = job
        buffer = bytearray(piece)
        return os.preadv(fds[path], [buffer], offset)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            total = sum(pool.map(read, jobs))
        seconds = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    evict(paths)
    return total, seconds
