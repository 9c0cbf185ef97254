"""Parallel shard reads: reads overlap conversion, staging memory stays within its pool, every chunk arrives
once with its bytes, and a failing read or consumer stops the load without leaving a thread behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.checkpoint.shards as shards
from engine.checkpoint.shards import (CheckpointError, Chunk, ReadTiming, plan_chunks, read_chunk, read_chunks,
                                      read_header)

STAGING = 64 << 10  # small staging buffers and pieces: many chunks, some too large for staging


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch):
    monkeypatch.setattr(shards, "STAGING_BYTES", STAGING)
    monkeypatch.setattr(shards, "CHUNK_BYTES", STAGING // 2)


def write_shard(path: Path, count: int, nbytes: int = 16 << 10, large: int = 0, seed: int = 0,
                prefix: str = "") -> Path:
    """`count` tensors of `nbytes` random bytes (and `large` more, each three staging buffers large)."""
    g = torch.Generator().manual_seed(seed)

    def noise(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    tensors = {f"{prefix}t{i:03d}": noise(nbytes) for i in range(count)}
    tensors.update({f"{prefix}big{i}": noise(3 * STAGING) for i in range(large)})
    save_file(tensors, str(path))
    return path


def chunks_of(*paths: Path) -> list[Chunk]:
    """Every tensor a chunk of its own."""
    return plan_chunks([t for p in paths for t in read_header(p)], lambda key: key, chunk_bytes=0)


def finishes(run: Callable[[], object], seconds: float = 30.0) -> object:
    """run()'s result or exception, failing (rather than hanging) when it does not return in time."""
    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = run()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "read_chunks did not return (deadlock?)"
    assert not [t for t in threading.enumerate() if t.name.startswith("glmflash-shards")], "a thread was left behind"
    if "error" in out:
        raise out["error"]
    return out["value"]


def slow_reads(monkeypatch, seconds: float) -> dict[str, float]:
    """Every read takes at least `seconds` (changed through the dict returned), as from a disk."""
    delay = {"s": seconds}
    pread = shards._pread

    def slow(*args) -> None:
        time.sleep(delay["s"])
        pread(*args)

    monkeypatch.setattr(shards, "_pread", slow)
    return delay


def test_reads_overlap_consumes(tmp_path, monkeypatch):
    """Reads and conversions 50 ms each: one after the other a thread needs 100 ms a chunk; overlapped the
    load takes half that, plus one read and one conversion."""
    count, step, workers = 40, 0.05, 2
    chunks = chunks_of(write_shard(tmp_path / "a.safetensors", count))
    slow_reads(monkeypatch, step)
    start = time.perf_counter()
    finishes(lambda: read_chunks(chunks, lambda *_: time.sleep(step), workers=workers))
    wall = time.perf_counter() - start
    serial = count * 2 * step / workers  # 2 s; overlapped 1.1 s
    assert wall < 0.75 * serial, f"wall {wall:.3f}s, reads and conversions one after the other: {serial:.3f}s"


def test_every_chunk_is_consumed_once_with_its_bytes(tmp_path):
    paths = [write_shard(tmp_path / f"{i}.safetensors", 20, nbytes=(3 + i) << 10, large=2, seed=i,
                         prefix=f"f{i}.") for i in range(2)]
    chunks = plan_chunks([t for p in paths for t in read_header(p)], lambda key: key[:4])  # several tensors a chunk
    assert any(c.own_buffer for c in chunks) and any(len(c.tensors) > 1 for c in chunks)
    stored = {k: v for p in paths for k, v in load_file(str(p)).items()}
    got: dict[str, torch.Tensor] = {}
    lock = threading.Lock()
    seen: list[tuple[int, int]] = []

    def consume(chunk: Chunk, views: list[torch.Tensor], staging: torch.Tensor | None) -> None:
        assert (staging is None) == chunk.own_buffer
        with lock:
            for t, view in zip(chunk.tensors, views):
                assert t.key not in got, f"{t.key} consumed twice"
                got[t.key] = view.clone()

    total = finishes(lambda: read_chunks(chunks, consume, workers=3, progress=lambda *p: seen.append(p)))
    assert got.keys() == stored.keys()
    assert all(torch.equal(got[k], v) for k, v in stored.items())
    assert total == sum(c.nbytes for c in chunks) == seen[-1][0] == seen[-1][1]


def test_staging_buffers_in_flight_stay_within_the_pool(tmp_path, monkeypatch):
    """A slow consumer: readers run ahead until every pooled buffer holds a chunk, and no further; buffers of
    their own are held back the same way."""
    workers = 2
    chunks = chunks_of(write_shard(tmp_path / "a.safetensors", 40, large=6))
    made, lock = [], threading.Lock()
    staging_buffer = shards.staging_buffer
    monkeypatch.setattr(shards, "staging_buffer", lambda pin=False: made.append(1) or staging_buffer(pin))
    held: dict[int, int] = {}  # chunk -> 1 from its first read until it is consumed
    most = {"staged": 0, "own": 0, "consuming": 0}
    consuming = [0]
    pread = shards._pread

    def counted(fd, into, offset, chunk) -> None:
        with lock:
            held[id(chunk)] = chunk.own_buffer
            most["staged"] = max(most["staged"], sum(1 for own in held.values() if not own))
            most["own"] = max(most["own"], sum(held.values()))
        pread(fd, into, offset, chunk)

    def consume(chunk: Chunk, views: list[torch.Tensor], staging: torch.Tensor | None) -> None:
        with lock:
            consuming[0] += 1
            most["consuming"] = max(most["consuming"], consuming[0])
        time.sleep(0.02)
        with lock:
            consuming[0] -= 1
            del held[id(chunk)]

    monkeypatch.setattr(shards, "_pread", counted)
    finishes(lambda: read_chunks(chunks, consume, workers=workers))
    assert len(made) == most["staged"] == shards.STAGING_PER_WORKER * workers
    assert most["own"] == shards.OWN_BUFFERS
    assert most["consuming"] == workers


def test_a_failing_consumer_stops_the_load_and_is_raised(tmp_path):
    chunks = chunks_of(write_shard(tmp_path / "a.safetensors", 60, large=2))
    calls = []

    def consume(chunk: Chunk, views: list[torch.Tensor], staging: torch.Tensor | None) -> None:
        calls.append(chunk)
        if len(calls) == 3:
            raise RuntimeError("conversion failed")
        time.sleep(0.01)

    with pytest.raises(RuntimeError, match="conversion failed"):
        finishes(lambda: read_chunks(chunks, consume, workers=4))
    assert len(calls) < len(chunks) // 2


@pytest.mark.parametrize("inside", ["t029", "big0"], ids=["staged", "own-buffer"])
def test_a_file_truncated_while_loading_names_the_tensor(tmp_path, inside):
    path = write_shard(tmp_path / "a.safetensors", 30, large=1)
    chunks = chunks_of(path)
    cut = next(t for c in chunks for t in c.tensors if t.key == inside)
    with open(path, "r+b") as f:
        f.truncate(cut.offset + cut.nbytes // 2)
    consumed = []
    with pytest.raises(CheckpointError, match=r"a.safetensors: ends at byte \d+, inside tensor '\w+'"):
        finishes(lambda: read_chunks(chunks, lambda chunk, *_: consumed.append(chunk), workers=4))
    assert all(c.end <= cut.offset for c in consumed)


def test_timing_says_whether_the_disk_or_the_conversion_bounds_the_load(tmp_path, monkeypatch):
    """Readers that wait for buffers (`wait_s`) most of the wall: conversion-bound; hardly ever: disk-bound."""
    chunks = chunks_of(write_shard(tmp_path / "a.safetensors", 24))

    delay = slow_reads(monkeypatch, 0.0)

    def timed(read_s: float, consume_s: float) -> tuple[float, ReadTiming]:
        delay["s"] = read_s
        timing, start = ReadTiming(), time.perf_counter()
        finishes(lambda: read_chunks(chunks, lambda *_: time.sleep(consume_s), workers=2, timing=timing))
        return time.perf_counter() - start, timing

    wall, conversion_bound = timed(0.0, 0.04)
    assert conversion_bound.wait_s / 2 > 0.5 * wall and conversion_bound.consume_s / 2 > 0.8 * wall
    wall, disk_bound = timed(0.04, 0.0)
    assert disk_bound.wait_s / 2 < 0.1 * wall and disk_bound.read_s / 2 > 0.8 * wall
    assert "wait_s=" in disk_bound.summary(wall, 2)


def test_read_chunk_consumes_on_the_calling_thread(tmp_path):
    path = write_shard(tmp_path / "a.safetensors", 3)
    chunk = chunks_of(path)[1]
    staging = shards.staging_buffer()
    seen = []
    assert read_chunk(chunk, lambda c, views, s: seen.append((threading.get_ident(), views[0].clone(), s)),
                      staging) == chunk.nbytes
    assert seen[0][0] == threading.get_ident() and seen[0][2] is staging
    assert torch.equal(seen[0][1], load_file(str(path))[chunk.tensors[0].key])
