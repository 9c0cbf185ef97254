"""The prepared snapshot on disk: named byte regions in a few large files, written and read back in parallel.

Knows bytes, not tensors: the engine hands over its final buffers piece by piece (to write from)
or memoryviews of them (to read into). Regions start on 4 KiB boundaries; each is cut into pieces
of at most `PIECE_BYTES`, checksummed when written and verified while being read back, so a fast
resume re-reads every byte once and still detects damage. The checksum is zlib's CRC-32: several
times the speed of a cryptographic hash (reading stays disk-bound on a few cores), certain to catch
a flipped bit or a short burst, and blind to other damage once in 2**32. Files are listed in the
order they should be loaded (the engine puts non-expert weights first).

A snapshot is written into `<directory>.partial` and renamed to `<directory>` only once every
byte, the plan and the directory are on disk, so a process killed at any point leaves nothing at
`<directory>` that `check_prepared` accepts. The partial write is resumable: it holds what it is
writing (`layout.json`: the plan without its checksums, the piece size) and a journal of the pieces already on disk
(each line appended only after the data files were synced), so a write stopped, killed or cut off
by a worker's stop carries on where it was when the next one writes the same layout, where starting
over would cost a release-sized snapshot's minutes again each time.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
import zlib
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


class PreparedSnapshotError(ValueError):
    """A prepared snapshot that cannot be read back as it was written (names the file and the region).

    A damaged piece found on reading also carries its `file` and `piece` (region key `key@start`), for the
    owner's log line."""

    def __init__(self, message: str, file: Path | None = None, piece: str | None = None) -> None:
        super().__init__(message)
        self.file, self.piece = file, piece


log = logging.getLogger("glmflash.engine")

ALIGN = 4096
PIECE_BYTES = 64 << 20
PLAN_NAME = "plan.json"
LAYOUT_NAME = "layout.json"  # a partial write's plan without checksums and its piece size: what it writes
JOURNAL_NAME = "journal"  # a partial write's "key@start crc32" lines, one per piece synced to disk
JOURNAL_EVERY_S = 1.0  # the data synced and the journal appended at least this often


@dataclass
class Region:
    """One named byte range of a prepared file, with the hashes of its pieces."""

    key: str
    file: str
    offset: int
    size: int
    hashes: list[str] = field(default_factory=list)


@dataclass
class PreparedPlan:
    format_version: int
    engine_version: str
    meta: dict  # engine-owned description (tensor records); opaque here
    files: dict[str, int]  # file name -> size, in load order
    regions: list[Region]
    complete: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PreparedPlan":
        raw = json.loads(text)
        raw["regions"] = [Region(**r) for r in raw["regions"]]
        return cls(**raw)


def _digest(view: memoryview) -> str:
    return f"{zlib.crc32(view):08x}"


def _pieces(size: int) -> list[tuple[int, int]]:
    return [(start, min(PIECE_BYTES, size - start)) for start in range(0, size, PIECE_BYTES)] or [(0, 0)]


def _piece_key(key: str, start: int) -> str:
    """`key@start` of the piece at `start` in the region keyed `key` (itself a piece's key or a whole region's)."""
    base, _, at = key.partition("@")
    return f"{base}@{int(at or 0) + start}"


def piece_regions(region: Region) -> list[Region]:
    """The region cut into its checksummed pieces, each a region of its own keyed `key@start`, so that part
    of it can be read (and verified) alone."""
    return [Region(_piece_key(region.key, start), region.file, region.offset + start, size, [digest])
            for (start, size), digest in zip(_pieces(region.size), region.hashes)]


PieceSource = Callable[[str, int, int, Any], memoryview]
"""(region key, offset inside the region, size, a free staging buffer or None) -> the piece's bytes: a
view of the region's own memory, or of the staging buffer filled with them (GPU memory goes this way)."""


def partial_dir(directory: Path) -> Path:
    return directory.with_name(directory.name + ".partial")


def discard_prepared(directory: Path, keep_partial: Callable[[dict], bool] = lambda meta: False) -> None:
    """Remove a prepared snapshot, and any unfinished write of one (its space is needed for the next) unless
    `keep_partial` accepts that write's meta: the next write of the same layout resumes it."""
    shutil.rmtree(directory, ignore_errors=True)
    layout = _partial_layout(partial_dir(directory))
    if layout is None or not keep_partial(layout.get("plan", {}).get("meta", {})):
        shutil.rmtree(partial_dir(directory), ignore_errors=True)


def _partial_layout(partial: Path) -> dict | None:
    try:
        return json.loads((partial / LAYOUT_NAME).read_text())
    except (OSError, ValueError):
        return None


def _journal(partial: Path) -> dict[str, str]:
    """The pieces a partial write has on disk: piece key -> crc32. A line cut short by a kill (no newline
    after it) is not one."""
    try:
        text = (partial / JOURNAL_NAME).read_text()
    except OSError:
        return {}
    done = {}
    for line in text.split("\n")[:-1]:
        key, _, digest = line.rpartition(" ")
        if key and len(digest) == 8:
            done[key] = digest
    return done


def _resume_or_start(partial: Path, layout: str) -> dict[str, str]:
    """The journal of the partial write at `partial` if it writes this layout; otherwise a fresh partial
    directory holding the layout, and no pieces done."""
    try:
        if (partial / LAYOUT_NAME).read_text() == layout:
            return _journal(partial)
        log.info("event=prepared_snapshot state=starting_over path=%s reason=another_layout", partial)
    except OSError:
        pass  # no partial write, or one from before partial writes kept their layout
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write_durably(partial / LAYOUT_NAME, layout.encode())
    _fsync_dir(partial)
    return {}


def invalidate_prepared(directory: Path) -> bool:
    """Unseal a prepared snapshot found damaged after it was loaded from: its plan goes (durably), so no later
    start trusts it (the next one is cold and discards the rest), while the process holding the plan still
    reads the sound pieces. True if this call removed the plan."""
    try:
        (directory / PLAN_NAME).unlink()
    except FileNotFoundError:
        return False
    _fsync_dir(directory)
    return True


def write_prepared(directory: Path, files: Sequence[tuple[str, Sequence[tuple[str, int]]]], piece: PieceSource,
                   format_version: int, engine_version: str, meta: dict, workers: int = 8,
                   staging: Sequence[Any] = (), stop: threading.Event | None = None,
                   pace: Callable[[int], None] | None = None) -> PreparedPlan:
    """Write each (file name, [(region key, size)]) file from the bytes `piece` hands over, `workers`
    pieces at a time (filled, hashed and written in parallel); staged and swapped in as the module says.
    A partial write of the same layout is resumed: its journaled pieces are not asked for again.

    `staging`: the caller's buffers (of at least PIECE_BYTES), one per worker, lent to `piece` in turn
    (none given: `piece` gets None).
    Setting `stop` ends the write (PreparedSnapshotError) with the pieces written so far journaled, for the
    next write to resume; any other failure removes the partial files. `pace(size)` is called on the writing
    thread before each piece (a caller's way to slow the write down). Written pages leave the page cache as
    they are synced: the write must not evict what serving reads.
    """
    stop, halt = stop or threading.Event(), threading.Event()  # asked to stop; stopping after a failure
    partial = partial_dir(directory)
    plan = PreparedPlan(format_version, engine_version, meta, {}, [])
    for file_name, items in files:
        offset = 0
        for key, size in items:
            offset = -(-offset // ALIGN) * ALIGN
            plan.regions.append(Region(key, file_name, offset, size))
            offset += size
        plan.files[file_name] = offset
    done = _resume_or_start(partial, json.dumps({"piece_bytes": PIECE_BYTES, "plan": asdict(plan)}))
    jobs = [(region, start, size) for region in plan.regions for start, size in _pieces(region.size)
            if _piece_key(region.key, start) not in done]
    if done:
        log.info("event=prepared_snapshot state=resuming path=%s pieces_done=%d pieces_left=%d", directory,
                 len(done), len(jobs))
    fds: dict[str, int] = {}
    try:
        for file_name, size in plan.files.items():
            fds[file_name] = os.open(partial / file_name, os.O_WRONLY | os.O_CREAT, 0o644)
            _reserve(fds[file_name], size, partial / file_name)
        free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for buffer in staging or [None] * workers:
            free.put(buffer)

        def write(job: tuple[Region, int, int]) -> str:
            if stop.is_set() or halt.is_set():
                raise PreparedSnapshotError(f"{directory}: writing stopped")
            region, start, size = job
            if pace is not None:
                pace(size)
            buffer = free.get()
            try:
                view = piece(region.key, start, size, buffer).cast("B")
                if len(view) != size:
                    raise PreparedSnapshotError(f"prepared region {region.key}: got {len(view)} bytes at {start}, "
                                                f"expected {size}")
                written, offset = 0, region.offset + start
                while written < size:
                    written += os.pwrite(fds[region.file], view[written:], offset + written)
                return _digest(view)
            finally:
                free.put(buffer)

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="glmflash-prepare") as pool:
            futures = {pool.submit(write, job): _piece_key(job[0].key, job[1]) for job in jobs}
            _journal_as_written(partial, futures, fds, done, halt)
        for region in plan.regions:
            region.hashes = [done[_piece_key(region.key, start)] for start, _ in _pieces(region.size)]
        for fd in fds.values():
            os.fsync(fd)
        plan.complete = True
        _write_durably(partial / PLAN_NAME, plan.to_json().encode())
        (partial / JOURNAL_NAME).unlink(missing_ok=True)
        (partial / LAYOUT_NAME).unlink()
        _fsync_dir(partial)
    except BaseException:
        if not stop.is_set():
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(partial, directory)
    _fsync_dir(directory.parent)
    return plan


def _journal_as_written(partial: Path, futures: dict[Future, str], fds: dict[str, int], done: dict[str, str],
                        halt: threading.Event) -> None:
    """Wait for the pieces' writes; at least every JOURNAL_EVERY_S, the data files synced and then the pieces
    finished before it appended to the journal (into `done` too). A failure (a stop included) halts the rest:
    the ones under way finish and are journaled, then it is raised."""
    pending = set(futures)
    failure: BaseException | None = None
    with open(partial / JOURNAL_NAME, "a") as journal:
        while pending:
            finished, pending = wait(pending, timeout=JOURNAL_EVERY_S, return_when=FIRST_EXCEPTION)
            ok = [f for f in finished if f.exception() is None]
            failure = failure or next((f.exception() for f in finished if f.exception() is not None), None)
            if failure is not None:
                halt.set()
            if ok:
                for fd in fds.values():
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: the cache is serving's
                journal.write("".join(f"{futures[f]} {f.result()}\n" for f in ok))
                journal.flush()
                os.fsync(journal.fileno())
                done.update((futures[f], f.result()) for f in ok)
    if failure is not None:
        raise failure


def _reserve(fd: int, size: int, path: Path) -> None:
    """Claim the file's blocks up front, so a full volume fails now, naming the file, not half-way through."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise PreparedSnapshotError(f"{path}: not enough disk space for {size} bytes") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_plan(directory: Path) -> PreparedPlan | None:
    path = directory / PLAN_NAME
    if not path.exists():
        return None
    try:
        return PreparedPlan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise PreparedSnapshotError(f"{path}: unreadable prepared plan ({exc})") from exc



def prepared_files(directory: Path) -> list[tuple[Path, int]]:
    """A whole prepared snapshot's files and sizes in load order (what a start can read ahead); [] without one."""
    try:
        plan = read_plan(directory)
    except PreparedSnapshotError:
        return []
    if plan is None or not plan.complete:
        return []
    return [(directory / name, size) for name, size in plan.files.items()]

def check_prepared(directory: Path, format_version: int, engine_version: str) -> list[str]:
    """Cheap validity checks (no data read): problems found, empty when the snapshot can be loaded."""
    try:
        plan = read_plan(directory)
    except PreparedSnapshotError as exc:
        return [str(exc)]
    if plan is None:
        return [f"{directory / PLAN_NAME}: missing"]
    problems = []
    if not plan.complete:
        problems.append("prepared snapshot is incomplete")
    if plan.format_version != format_version:
        problems.append(f"prepared format {plan.format_version} != {format_version}")
    if plan.engine_version != engine_version:
        problems.append(f"prepared by engine {plan.engine_version}, this is {engine_version}")
    for name, size in plan.files.items():
        path = directory / name
        found = path.stat().st_size if path.exists() else None
        if found != size:
            problems.append(f"{path}: expected {size} bytes, found {found}")
    return problems


@dataclass
class ReadStats:
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


PieceSink = Callable[[str, int, memoryview], None]  # (region key, offset inside the region, the piece's bytes)


def read_regions(directory: Path, plan: PreparedPlan, destinations: Mapping[str, memoryview] | None = None,
                 workers: int = 8, verify: bool = True, sink: PieceSink | None = None,
                 staging: Sequence[memoryview] = ()) -> ReadStats:
    """Read every region with `workers` parallel preads, verifying piece hashes; regions go in plan order,
    so the files listed first (non-expert weights) land first.

    With `destinations` the pieces land straight in those buffers (host memory). With `sink` and
    `staging` (reusable buffers of at least PIECE_BYTES, as many as workers), each piece is read into
    a free staging buffer and handed to `sink`, which must be done with it when it returns (a copy to
    GPU memory); nothing larger than the staging buffers is ever held on the host.
    """
    if (destinations is None) == (sink is None) or (sink is not None and len(staging) < workers):
        raise ValueError("give destinations, or a sink with one staging buffer per worker")
    start = time.perf_counter()
    free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
    for buffer in staging:
        free.put(buffer.cast("B"))
    fds = {name: os.open(directory / name, os.O_RDONLY) for name in plan.files}

    def read(job: tuple[Region, int, int, str]) -> int:
        region, piece_start, piece_size, digest = job
        buffer = free.get() if sink is not None else None
        try:
            view = (buffer[:piece_size] if buffer is not None
                    else destinations[region.key].cast("B")[piece_start:piece_start + piece_size])
            done, offset = 0, region.offset + piece_start
            while done < piece_size:
                n = os.preadv(fds[region.file], [view[done:]], offset + done)
                if n == 0:
                    raise PreparedSnapshotError(f"{directory / region.file}: ends early inside {region.key}",
                                                directory / region.file, _piece_key(region.key, piece_start))
                done += n
            if verify and _digest(view) != digest:
                raise PreparedSnapshotError(
                    f"{directory / region.file}: checksum mismatch in {region.key} at offset {offset}",
                    directory / region.file, _piece_key(region.key, piece_start))
            if sink is not None:
                sink(region.key, piece_start, view)
            return done
        finally:
            if buffer is not None:
                free.put(buffer)

    try:
        jobs = []
        for region in plan.regions:
            if destinations is not None and len(destinations[region.key].cast("B")) != region.size:
                raise PreparedSnapshotError(f"prepared region {region.key}: buffer has "
                                            f"{len(destinations[region.key].cast('B'))} bytes, file {region.file} "
                                            f"holds {region.size}")
            jobs += [(region, start_, size, digest)
                     for (start_, size), digest in zip(_pieces(region.size), region.hashes)]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            total = sum(pool.map(read, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return ReadStats(total, time.perf_counter() - start)
