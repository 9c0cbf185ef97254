"""A prepared snapshot's first files read into the page cache while the process imports torch and the engine.

From process start to a fast_resume's first read, an H200 host spent 5-7 s importing torch, CUDA and the
engine with the disk idle (boot logs: `event=compile_cache` to the load stage), and that load is disk-bound.
posix_fadvise(WILLNEED) has the kernel read the files, in the plan's load order, meanwhile; the load's
buffered reads then find those pages in memory. At most READAHEAD_BYTES and a quarter of the free memory;
nothing for a cold start, whose reads convert as they go (CPU-bound, not disk-bound).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from engine.checkpoint.prepared_store import PreparedSnapshotError, read_plan

READAHEAD_BYTES = 16 << 30
STEP_BYTES = 256 << 20  # one WILLNEED call: the thread can be abandoned between two


def readahead_plan(prepared: Path, limit: int) -> list[tuple[Path, int]]:
    """(file, leading bytes to read ahead) in the load's order, `limit` bytes in all; [] without a whole
    prepared snapshot there."""
    try:
        plan = read_plan(prepared)
    except PreparedSnapshotError:
        return []
    if plan is None or not plan.complete:
        return []
    files, left = [], limit
    for name, size in plan.files.items():
        if left <= 0:
            break
        files.append((prepared / name, min(size, left)))
        left -= size
    return files


def free_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def start_readahead(prepared: Path, limit: int | None = None) -> int:
    """Read ahead on a daemon thread -> bytes asked for (0: nothing to read, or no posix_fadvise here)."""
    limit = min(READAHEAD_BYTES, free_memory() // 4) if limit is None else limit
    files = readahead_plan(prepared, limit)
    if not files or not hasattr(os, "posix_fadvise"):
        return 0
    threading.Thread(target=_advise, args=(files,), name="glmflash-readahead", daemon=True).start()
    return sum(nbytes for _, nbytes in files)


def _advise(files: list[tuple[Path, int]]) -> None:
    for path, nbytes in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # the load reports a missing file; a hint has nothing to add
            continue
        try:
            for offset in range(0, nbytes, STEP_BYTES):
                os.posix_fadvise(fd, offset, min(STEP_BYTES, nbytes - offset), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
