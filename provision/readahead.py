"""The first files a start will load, read into the page cache while the process imports torch and the engine.

From process start to the first read, an H200 host spent 5-7 s importing torch, CUDA and the engine with the
disk idle (boot logs: `event=compile_cache` to the load stage). posix_fadvise(WILLNEED) has the kernel read
the files meanwhile, in the order the load reads them: a prepared snapshot's (fast_resume; the caller lists
them, the format is the engine's), else a local source snapshot's safetensors (a cold start from the volume);
the load's buffered reads then find those pages in memory. At most READAHEAD_BYTES and a quarter of the free
memory. A snapshot still to be downloaded has nothing to read ahead.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

READAHEAD_BYTES = 16 << 30
STEP_BYTES = 256 << 20  # one WILLNEED call: the thread can be abandoned between two


def snapshot_files(directory: Path) -> list[tuple[Path, int]]:
    """A local snapshot's safetensors files and sizes, in the loader's (name) order; [] for anything else."""
    if not directory.is_dir():
        return []
    return [(path, path.stat().st_size) for path in sorted(directory.glob("*.safetensors"))]


def within(files: list[tuple[Path, int]], limit: int) -> list[tuple[Path, int]]:
    """The leading bytes of `files` to read ahead, `limit` in all: (file, bytes)."""
    taken, left = [], limit
    for path, size in files:
        if left <= 0:
            break
        taken.append((path, min(size, left)))
        left -= size
    return taken


def free_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def start_readahead(files: list[tuple[Path, int]], limit: int | None = None) -> int:
    """Read `files` ahead (at most `limit` bytes; default READAHEAD_BYTES and a quarter of the free memory) on a
    daemon thread -> bytes asked for (0: nothing to read, or no posix_fadvise here)."""
    files = within(files, min(READAHEAD_BYTES, free_memory() // 4) if limit is None else limit)
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
