"""The first files a start will load, read into the page cache from the end of the imports to the load's first read.

Between the imports and the load's first read (the memory plan, the host banks' allocation, the kernels'
preload: ~3 s of a fast_resume on an H100) the disk would sit idle. posix_fadvise(WILLNEED) has the kernel read
the files meanwhile, in the order the load reads them: a prepared snapshot's (fast_resume; the caller lists
them, the format is the engine's), else a local source snapshot's safetensors (a cold start from the volume);
the load's buffered reads then find those pages in memory. At most READAHEAD_BYTES and a quarter of the free
memory. A snapshot still to be downloaded has nothing to read ahead. Started before the imports instead, the
readahead slowed them more than it saved the load (an H100's cold start: listening 7 s later, the load 2.4 s
shorter): the imports' page faults wait behind its reads.

Linux reads at most the device's readahead window (the larger of read_ahead_kb and max_sectors_kb: 128 KiB to
a few MiB) for one WILLNEED call and drops the rest of the range: calls of 256 MiB left 32 MiB of a 1 GiB file
cached. So the advice goes ADVICE_BYTES at a time, ~130,000 calls for 16 GiB, in a process of its own: on a
thread, each call would wait for the GIL that the start's own threads hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

READAHEAD_BYTES = 16 << 30
ADVICE_BYTES = 128 << 10  # one WILLNEED call: Linux's default readahead window, the least a device reads for one


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


@dataclass
class Readahead:
    """A started readahead: the bytes asked for and the process asking (None: nothing to read)."""

    bytes: int
    process: subprocess.Popen | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Until every call has been made (the reads they started may still be under way)."""
        if self.process is not None:
            self.process.wait(timeout)


def start_readahead(files: list[tuple[Path, int]], limit: int | None = None) -> Readahead:
    """Read `files` ahead (at most `limit` bytes; default READAHEAD_BYTES and a quarter of the free memory) from a
    child process that ends once it has asked for every byte."""
    files = within(files, min(READAHEAD_BYTES, free_memory() // 4) if limit is None else limit)
    if not files or not hasattr(os, "posix_fadvise"):
        return Readahead(0)
    arguments = [str(part) for path, nbytes in files for part in (path, nbytes)]
    process = subprocess.Popen([sys.executable, "-m", "provision.readahead", *arguments], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL)
    return Readahead(sum(nbytes for _, nbytes in files), process)


def _advise(files: list[tuple[Path, int]], step: int = ADVICE_BYTES) -> None:
    """WILLNEED over the leading bytes of each file, `step` bytes a call."""
    for path, nbytes in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # the load reports a missing file; a hint has nothing to add
            continue
        try:
            for offset in range(0, nbytes, step):
                os.posix_fadvise(fd, offset, min(step, nbytes - offset), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


if __name__ == "__main__":  # the child start_readahead starts: PATH BYTES pairs
    _advise([(Path(path), int(nbytes)) for path, nbytes in zip(sys.argv[1::2], sys.argv[2::2])])
