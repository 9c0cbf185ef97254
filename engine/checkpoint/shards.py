"""Safetensors shards read at disk speed: byte ranges from the headers, large parallel reads.

A shard starts with an 8-byte length and a JSON header that says where each tensor's bytes sit, so
the whole checkpoint can be planned before any data is read. Tensors are then read in chunks of
neighbours (about `CHUNK_BYTES`, ending where the caller's groups end when possible); a tensor too
large for a staging buffer gets a buffer of its own, filled by all readers in pieces.
Reading and converting overlap: `workers` reader threads keep that many reads in flight, each into a
staging buffer taken from a pool (page-locked when the weights go to a GPU), and hand what they read to
`workers` consumer threads, which convert and place it and give the buffer back. The pool holds at most
`STAGING_PER_WORKER` x `workers` buffers of `STAGING_BYTES` and at most `OWN_BUFFERS` buffers of their own
exist at once, so host memory stays bounded whatever the checkpoint: a reader waits for a free buffer
only when the consumers are behind (a conversion-bound load), never for a conversion of its own.
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import threading
import time
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
# Staging buffers per reader: one being read into while the one read before it is converted, so the disk
# never waits on a conversion. Page-locked memory cannot be swapped out and shares host RAM with the pinned
# expert banks, so a load's share must stay fixed, not grow with the checkpoint (2 x 8 x 96 MiB = 1.5 GiB).
STAGING_PER_WORKER = 2
OWN_BUFFERS = 2  # buffers of their own (GBs each for an embedding) alive at once: one converted, the next read

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
    """Seconds spent reading, converting (in the consumer) and waiting for a free buffer, each summed over
    its threads: next to the wall time they say what bounds a load (a disk-bound one reads nearly all
    the time and never waits; a conversion-bound one consumes nearly all the time while its readers wait)."""

    read_s: float = 0.0
    consume_s: float = 0.0
    wait_s: float = 0.0

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
        """key=value: the wall time and each part per thread (`threads` readers and as many consumers)."""
        return (f"wall_s={wall_s:.3f} threads={threads} read_s={self.read_s / threads:.3f} "
                f"consume_s={self.consume_s / threads:.3f} wait_s={self.wait_s / threads:.3f}")


def read_chunks(chunks: Sequence[Chunk], consume: Consumer, workers: int = 8, pin_memory: bool = False,
                progress: Callable[[int, int], None] | None = None, timing: ReadTiming | None = None) -> int:
    """Read every chunk with `workers` reader threads and hand each to `consume`, called from `workers`
    consumer threads (several at once) while the next chunks are read. Chunks with a buffer of their own
    go first, split into pieces across readers. `progress(done_bytes, total_bytes)` follows the reads;
    `timing` adds up where the threads' time went. The first exception stops the rest and is raised once
    every thread has finished. Returns the bytes read."""
    return _Load(chunks, consume, max(1, workers), pin_memory, progress, timing or ReadTiming()).run()


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
        _pread(fd, staging[:chunk.nbytes], chunk.start, chunk)
    finally:
        os.close(fd)
    consume(chunk, _views(staging, chunk), staging)
    return chunk.nbytes


_DONE = object()  # put on the hand-off queue once per consumer after the last read


class _Load:
    """One `read_chunks` call: readers take jobs in order (the pieces of chunks with a buffer of their own
    first), read them into pooled buffers and queue them; consumers convert them and free the buffers."""

    def __init__(self, chunks: Sequence[Chunk], consume: Consumer, workers: int, pin_memory: bool,
                 progress: Callable[[int, int], None] | None, timing: ReadTiming) -> None:
        self.consume, self.workers, self.progress, self.timing = consume, workers, progress, timing
        jobs = _jobs(chunks)
        self.total, self.done = sum(hi - lo for _, lo, hi in jobs), 0
        self.jobs = iter(jobs)
        self.own = {id(c): _OwnBuffer(c) for c in chunks if c.own_buffer}
        self.own_slots = _Slots(OWN_BUFFERS)
        self.staging = _StagingPool(STAGING_PER_WORKER * workers, pin_memory)
        self.handoff: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.fds = {path: os.open(path, os.O_RDONLY) for path in {c.path for c in chunks}}

    def run(self) -> int:
        readers = [_start(self._reader, f"read-{i}") for i in range(self.workers)]
        consumers = [_start(self._consumer, f"consume-{i}") for i in range(self.workers)]
        try:
            for thread in readers:
                thread.join()
        except BaseException as exc:  # interrupted while waiting: stop the threads the finally waits for
            self._fail(exc)
            raise
        finally:
            for thread in readers:
                thread.join()
            for _ in consumers:
                self.handoff.put(_DONE)
            for thread in consumers:
                thread.join()
            for fd in self.fds.values():
                os.close(fd)
        if self.error is not None:
            raise self.error
        return self.total

    def _reader(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                chunk, lo, hi = job
                if not (self._read_piece(chunk, lo, hi) if chunk.own_buffer else self._read_staged(chunk)):
                    return
                self._advance(hi - lo)
        except BaseException as exc:
            self._fail(exc)

    def _next_job(self) -> tuple[Chunk, int, int] | None:
        with self.lock:
            return None if self.error is not None else next(self.jobs, None)

    def _read_staged(self, chunk: Chunk) -> bool:
        """Read a chunk into a free staging buffer and queue it; False once the load has stopped."""
        with self.timing.timed("wait_s"):
            staging = self.staging.take()
        if staging is None:
            return False
        with self.timing.timed("read_s"):
            _pread(self.fds[chunk.path], staging[:chunk.nbytes], chunk.start, chunk)
        self.handoff.put((chunk, staging))
        return True

    def _read_piece(self, chunk: Chunk, lo: int, hi: int) -> bool:
        """Read one piece of a chunk with a buffer of its own, queued once its last piece is in; False once
        the load has stopped."""
        state = self.own[id(chunk)]
        with self.timing.timed("wait_s"):
            buffer = state.buffer(self.own_slots)
        if buffer is None:
            return False
        with self.timing.timed("read_s"):
            _pread(self.fds[chunk.path], buffer[lo:hi], chunk.start + lo, chunk)
        if state.piece_done():
            self.handoff.put((chunk, None))
        return True

    def _advance(self, nbytes: int) -> None:
        if self.progress is not None:
            with self.lock:
                self.done += nbytes
                self.progress(self.done, self.total)

    def _consumer(self) -> None:
        while (item := self.handoff.get()) is not _DONE:
            chunk, staging = item
            try:
                if self.error is None:  # after a failure the queue is only drained, freeing buffers
                    buffer = staging if staging is not None else self.own[id(chunk)].tensor
                    with self.timing.timed("consume_s"):
                        self.consume(chunk, _views(buffer, chunk), staging)
            except BaseException as exc:
                self._fail(exc)
            finally:
                self._release(chunk, staging)

    def _release(self, chunk: Chunk, staging: torch.Tensor | None) -> None:
        if staging is not None:
            self.staging.give(staging)
        else:
            self.own[id(chunk)].tensor = None
            self.own_slots.give()

    def _fail(self, exc: BaseException) -> None:
        """Keep the first error and wake every waiting reader: no thread is left waiting on a stopped load."""
        with self.lock:
            if self.error is None:
                self.error = exc
        self.staging.slots.stop()
        self.own_slots.stop()


def _jobs(chunks: Sequence[Chunk]) -> list[tuple[Chunk, int, int]]:
    """(chunk, first byte, end byte) to read: chunks with a buffer of their own first, in pieces."""
    jobs: list[tuple[Chunk, int, int]] = []
    for chunk in sorted(chunks, key=lambda c: not c.own_buffer):
        if chunk.own_buffer:
            jobs += [(chunk, lo, min(lo + CHUNK_BYTES, chunk.nbytes)) for lo in range(0, chunk.nbytes, CHUNK_BYTES)]
        else:
            jobs.append((chunk, 0, chunk.nbytes))
    return jobs


def _start(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=f"glmflash-shards-{name}", daemon=True)
    thread.start()
    return thread


class _Slots:
    """How many more of something may exist at once; `stop` wakes every waiter for good (a failed load)."""

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.stopped = False
        self.cond = threading.Condition()

    def take(self) -> bool:
        """Wait for a free slot; False once stopped."""
        with self.cond:
            self.cond.wait_for(lambda: self.free > 0 or self.stopped)
            if self.stopped:
                return False
            self.free -= 1
            return True

    def give(self) -> None:
        with self.cond:
            self.free += 1
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _StagingPool:
    """At most `count` staging buffers, each allocated when first needed (a small load pins little) and reused."""

    def __init__(self, count: int, pin_memory: bool) -> None:
        self.slots = _Slots(count)
        self.pin_memory = pin_memory
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self) -> torch.Tensor | None:
        """A free buffer, waiting for one if all are taken; None once the load has stopped."""
        if not self.slots.take():
            return None
        with self.lock:
            if self.free:
                return self.free.pop()
        return staging_buffer(self.pin_memory)

    def give(self, buffer: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buffer)
        self.slots.give()


class _OwnBuffer:
    """The buffer of a chunk too large for staging, allocated by its first piece, consumed after its last."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.left = math.ceil(chunk.nbytes / CHUNK_BYTES)
        self.tensor: torch.Tensor | None = None
        self.lock = threading.Lock()

    def buffer(self, slots: _Slots) -> torch.Tensor | None:
        """The buffer, allocated once one of `slots` is free; None once the load has stopped."""
        with self.lock:
            if self.tensor is None:
                if not slots.take():
                    return None
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
