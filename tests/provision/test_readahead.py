"""Reading a prepared snapshot ahead of the load: which files and how much, in the load's order;
nothing without a whole snapshot; and the page cache really holds the bytes afterwards, also of a file far larger
than the readahead window one WILLNEED call reads (Linux)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import pytest

from engine.checkpoint.prepared_store import prepared_files, write_prepared
from provision.readahead import snapshot_files, start_readahead, within

SIZES = {"r0": 300_000, "r1": 5_000, "r2": 700_000}


def prepared(directory):
    data = {key: bytes([i + 1]) * n for i, (key, n) in enumerate(SIZES.items())}
    files = [("b.bin", [("r0", SIZES["r0"])]), ("a.bin", [("r1", SIZES["r1"]), ("r2", SIZES["r2"])])]
    return write_prepared(directory, files, lambda key, start, size, _: memoryview(data[key])[start:start + size],
                          1, "v", {}, workers=2)


def test_a_prepared_snapshots_files_in_load_order_up_to_the_limit(tmp_path):
    plan = prepared(tmp_path / "prepared")
    b, a = tmp_path / "prepared" / "b.bin", tmp_path / "prepared" / "a.bin"
    files = prepared_files(tmp_path / "prepared")
    assert files == [(b, plan.files["b.bin"]), (a, plan.files["a.bin"])]  # the plan's load order, not the names'
    assert within(files, 1 << 30) == files
    assert within(files, plan.files["b.bin"] + 10) == [(b, plan.files["b.bin"]), (a, 10)]
    assert within(files, 0) == []


def test_a_local_snapshots_shards_and_nothing_else(tmp_path):
    for name, size in (("model-00002.safetensors", 7), ("model-00001.safetensors", 5), ("config.json", 3)):
        (tmp_path / name).write_bytes(b"x" * size)
    assert snapshot_files(tmp_path) == [(tmp_path / "model-00001.safetensors", 5),
                                        (tmp_path / "model-00002.safetensors", 7)]
    assert snapshot_files(tmp_path / "org" / "model") == []  # a hub id, not a directory here


def test_nothing_without_a_whole_prepared_snapshot(tmp_path):
    assert prepared_files(tmp_path / "absent") == [] and start_readahead([]).bytes == 0
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "plan.json").write_text("{not json")
    assert prepared_files(tmp_path / "torn") == []


def resident_pages(path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in all): mincore over a mapping of it, touching nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert libc.mincore(address, size, vec) == 0, ctypes.get_errno()
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), len(vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise as Linux has them")
def test_the_files_land_in_the_page_cache(tmp_path):
    prepared(tmp_path / "prepared")
    large = tmp_path / "large.bin"  # 48 MiB: a call for all of it would read one window (128 KiB to a few MiB)
    with open(large, "wb") as f:
        f.write(os.urandom(48 << 20))
        os.fsync(f.fileno())
    files = [tmp_path / "prepared" / name for name in ("b.bin", "a.bin")] + [large]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written durably: clean pages, dropped
        os.close(fd)
    if any(resident_pages(path)[0] for path in files):
        pytest.skip("this file system keeps the files in memory (tmpfs): nothing to read ahead")
    readahead = start_readahead(prepared_files(tmp_path / "prepared") + [(large, large.stat().st_size)])
    assert readahead.bytes == sum(os.path.getsize(path) for path in files)
    readahead.wait(60)
    # Readahead is best effort (the kernel may drop a readahead read when the device is congested): nine tenths of
    # each file. One call for a whole 48 MiB file would have read one window of it.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(r < 0.9 * n for r, n in map(resident_pages, files)):
        time.sleep(0.05)
    shares = [round(r / n, 3) for r, n in map(resident_pages, files)]
    assert all(share >= 0.9 for share in shares), shares
