"""Honest disk figures: files dropped from the page cache, and read back the way a fast loader reads (the disk's rate).

A load figure measured on files the page cache still holds is a memory figure; every benchmark that
reports a load rate evicts the files first (`evict`: fsync, then POSIX_FADV_DONTNEED, which only
drops clean pages) and reports it next to `raw_read` of the same files, evicted again, in the same run.
A virtual disk may also be cached below the machine (where eviction cannot reach), which flatters
whichever read comes second: benchmarks read raw before and after the load and compare with the
faster of the two.
"""

from __future__ import annotations

import os
import threading
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
    """(bytes, seconds): every byte of the files by `workers` parallel `piece`-sized preads, each thread
    into its own reused buffer (fresh memory per read would time page faults, not the disk); the files
    are evicted before and after."""
    paths = list(paths)
    evict(paths)
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, piece)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    local = threading.local()

    def read(job: tuple[Path, int]) -> int:
        path, offset = job
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(piece)
        view, done = memoryview(local.buffer), 0
        while done < piece and (n := os.preadv(fds[path], [view[done:]], offset + done)):
            done += n
        return done

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


def faster(a: tuple[int, float], b: tuple[int, float]) -> tuple[int, float]:
    """The quicker of two raw reads of the same bytes (the stricter yardstick)."""
    return a if a[1] <= b[1] else b
