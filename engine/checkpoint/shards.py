"""Safetensors shards read at disk speed: byte ranges from the headers, large parallel reads.

A shard starts with an 8-byte length and a JSON header that says where each tensor's bytes sit, so
the whole checkpoint can be planned before any data is read. Tensors are then read in chunks of
neighbours (about `CHUNK_BYTES`, ending where the caller's groups end when possible) by `workers`
threads, each into its own reused staging buffer (page-locked when the weights go to a GPU); a
tensor too large for a staging buffer gets a buffer of its own, filled by all threads in pieces.
Reading, converting and placing overlap: each thread hands its chunk to the consumer and reads the
next one as soon as the consumer returns.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import torch

CHUNK_BYTES = 64 << 20  # a chunk ends at the first group boundary past this ...
STAGING_BYTES = 96 << 20  # ... and never grows past this; a larger tensor is read into a buffer of its own
GAP_BYTES = 1 << 20  # skipped bytes (activation scales, say) read through rather than ending the chunk
PAGE = 4096
MAX_HEADER_BYTES = 100 << 20

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A snapshot cannot be loaded; the message names the file or tensor and what was expected."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: `offset` counts from the start of the file."""

    key: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file in file order, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is not plausible")
            raw = f.read(length)
            if len(raw) < length:
                raise ValueError("the file ends inside its header")
            header = json.loads(raw)
            size = os.fstat(f.fileno()).st_size
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: cannot read safetensors file ({exc})") from exc
    base = 8 + length
    tensors = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: unreadable header entry for {key!r} ({exc!r})") from exc
        need = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != need:
            raise CheckpointError(f"{path.name}: tensor {key!r} spans bytes {begin}-{end}, but its shape "
                                  f"{list(shape)} and dtype {entry['dtype']} need {need} bytes")
        if base + end > size:
            raise CheckpointError(f"{path.name}: truncated: tensor {key!r} ends at byte {base + end}, "
                                  f"the file has {size} bytes")
        tensors.append(StoredTensor(key, path, base + begin, need, dtype, shape))
    return sorted(tensors, key=lambda t: t.offset)


@dataclass
class Chunk:
    """Neighbouring tensors of one file, read with one request (`start` rounded down to a page)."""

    path: Path
    start: int
    end: int
    tensors: list[StoredTensor]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def own_buffer(self) -> bool:
        return self.nbytes > STAGING_BYTES


def plan_chunks(tensors: Iterable[StoredTensor], group_of: Callable[[str], Hashable],
                chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Chunks in file order. A chunk past `chunk_bytes` ends where `group_of` changes (so a weight's
    parts usually arrive in one chunk; 0: every group in chunks of its own), and always before it would
    pass STAGING_BYTES or skip more than GAP_BYTES of unread tensors."""
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for t in tensors:
        if current is not None:
            last = current.tensors[-1]
            fits = (t.path == last.path and 0 <= t.offset - current.end <= GAP_BYTES
                    and t.offset + t.nbytes - current.start <= STAGING_BYTES)
            at_boundary = current.nbytes >= chunk_bytes and group_of(t.key) != group_of(last.key)
            if fits and not at_boundary:
                current.tensors.append(t)
                current.end = t.offset + t.nbytes
                continue
        current = Chunk(t.path, t.offset // PAGE * PAGE, t.offset + t.nbytes, [t])
        chunks.append(current)
    return chunks


Consumer = Callable[[Chunk, list[torch.Tensor], "torch.Tensor | None"], None]
"""(chunk, a view of each of its tensors, the staging buffer they live in or None for a buffer of their
own). Views into a staging buffer are overwritten once the consumer returns."""


@dataclass
class ReadTiming:
    """Seconds the reading threads spent reading and in the consumer, summed over threads: next to the wall
    time it says what bounds a load (a disk-bound one reads nearly all the time, a conversion-bound one
    consumes)."""

    read_s: float = 0.0
    consume_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                setattr(self, part, getattr(self, part) + time.perf_counter() - start)

    def summary(self, wall_s: float, threads: int) -> str:
        """key=value: the wall time and each part per thread."""
        return (f"wall_s={wall_s:.3f} threads={threads} read_s={self.read_s / threads:.3f} "
                f"consume_s={self.consume_s / threads:.3f}")


def read_chunks(chunks: Sequence[Chunk], consume: Consumer, workers: int = 8, pin_memory: bool = False,
                progress: Callable[[int, int], None] | None = None, timing: ReadTiming | None = None) -> int:
    """Read every chunk with `workers` threads and hand each to `consume` (called from those threads,
    several at once). Chunks with a buffer of their own go first, split into pieces across threads.
    `progress(done_bytes, total_bytes)` follows the reads; `timing` adds up where the threads' time went.
    Returns the bytes read."""
    timing = timing or ReadTiming()
    jobs: list[tuple[Chunk, int, int]] = []
    for chunk in sorted(chunks, key=lambda c: not c.own_buffer):
        if chunk.own_buffer:
            jobs += [(chunk, lo, min(lo + CHUNK_BYTES, chunk.nbytes)) for lo in range(0, chunk.nbytes, CHUNK_BYTES)]
        else:
            jobs.append((chunk, 0, chunk.nbytes))
    total = sum(hi - lo for _, lo, hi in jobs)
    own: dict[int, _OwnBuffer] = {id(c): _OwnBuffer(c) for c in chunks if c.own_buffer}
    local = threading.local()
    lock = threading.Lock()
    done = [0]
    failed = threading.Event()
    fds = {path: os.open(path, os.O_RDONLY) for path in {c.path for c in chunks}}

    def run(job: tuple[Chunk, int, int]) -> int:
        if failed.is_set():
            return 0
        chunk, lo, hi = job
        try:
            if chunk.own_buffer:
                state = own[id(chunk)]
                with timing.timed("read_s"):
                    _pread(fds[chunk.path], state.buffer()[lo:hi], chunk.start + lo, chunk)
                if state.piece_done():
                    with timing.timed("consume_s"):
                        consume(chunk, _views(state.tensor, chunk), None)
                    state.tensor = None
            else:
                staging = getattr(local, "staging", None)
                if staging is None:
                    staging = local.staging = staging_buffer(pin_memory)
                _read_staged(fds[chunk.path], chunk, staging, consume, timing)
        except BaseException:
            failed.set()
            raise
        if progress is not None:
            with lock:
                done[0] += hi - lo
                progress(done[0], total)
        return hi - lo

    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="glmflash-shards") as pool:
            futures = [pool.submit(run, job) for job in jobs]
            return sum(f.result() for f in futures)
    finally:
        for fd in fds.values():
            os.close(fd)


def staging_buffer(pin_memory: bool = False) -> torch.Tensor:
    """A buffer any chunk but those with a buffer of their own fits in."""
    return torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=pin_memory)


def read_chunk(chunk: Chunk, consume: Consumer, staging: torch.Tensor) -> int:
    """Read one chunk on the calling thread through `staging` (see `staging_buffer`) and hand it to `consume`:
    a single read of a planned chunk, when a loader needs that one now. Returns the bytes read."""
    if chunk.own_buffer:
        return read_chunks([chunk], consume, workers=1)
    fd = os.open(chunk.path, os.O_RDONLY)
    try:
        _read_staged(fd, chunk, staging, consume)
    finally:
        os.close(fd)
    return chunk.nbytes


def _read_staged(fd: int, chunk: Chunk, staging: torch.Tensor, consume: Consumer,
                 timing: ReadTiming | None = None) -> None:
    timing = timing or ReadTiming()
    with timing.timed("read_s"):
        _pread(fd, staging[:chunk.nbytes], chunk.start, chunk)
    with timing.timed("consume_s"):
        consume(chunk, _views(staging, chunk), staging)


class _OwnBuffer:
    """The buffer of a chunk too large for staging, allocated by its first piece, consumed after its last."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.left = math.ceil(chunk.nbytes / CHUNK_BYTES)
        self.tensor: torch.Tensor | None = None
        self.lock = threading.Lock()

    def buffer(self) -> torch.Tensor:
        with self.lock:
            if self.tensor is None:
                self.tensor = torch.empty(self.chunk.nbytes, dtype=torch.uint8)
            return self.tensor

    def piece_done(self) -> bool:
        with self.lock:
            self.left -= 1
            return self.left == 0


def _pread(fd: int, into: torch.Tensor, offset: int, chunk: Chunk) -> None:
    view = memoryview(into.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{chunk.path.name}: ends at byte {offset + done}, inside tensor "
                                  f"{chunk.tensors[-1].key!r} (truncated while loading?)")
        done += n


def _views(buffer: torch.Tensor, chunk: Chunk) -> list[torch.Tensor]:
    views = []
    for t in chunk.tensors:
        raw = buffer[t.offset - chunk.start: t.offset - chunk.start + t.nbytes]
        if (t.offset - chunk.start) % t.dtype.itemsize:  # a misaligned tensor: copied to be viewed as its dtype
            raw = raw.clone()
        views.append(raw.view(t.dtype).reshape(t.shape))
    return views
