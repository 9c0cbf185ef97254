"""Download a snapshot into a verified, resumable local cache.

`download_snapshot(source, dest_dir)` (one at a time per directory, under an flock on
`dest_dir/.glmflash-download.lock`):

1. pins the source (`describe`) and lists its serving files;
2. keeps files already in place whose manifest entry matches the listing (same path, size and
   checksum; for sources without checksums also the same revision) and whose size on disk is right;
   removes files an earlier manifest listed that the source no longer has;
3. fetches the rest, up to `workers` files at once, each into `dest_dir/.partial/<path>`; a
   `<path>.glmflash-want` marker records which remote file (size, checksum, source) a partial
   belongs to, so a partial of another version is discarded instead of resumed;
4. verifies each file (size, then sha256 / md5 / multipart ETag as the source publishes, and always
   records the sha256 of the bytes), fsyncs it and renames it into place; a partial file is never
   visible at its final path;
5. rewrites the manifest (atomically) after every file, and with `complete: true` at the end.

Killing the process at any point loses at most the parts in flight: the next run skips finished
files and resumes partial ones (sources continue from the partial's size or, for S3, from the
sidecar of finished parts). A resumed file that fails verification is fetched once more from
scratch before the error is raised.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal

from .cache import (Manifest, ManifestFile, fsync_dir, hash_file, read_manifest, utc_now, verify_hashes,
                    write_manifest)
from .errors import ProvisionError
from .sources.base import (MANIFEST_NAME, PARTIAL_DIRNAME, PARTS_SUFFIX, WANT_SUFFIX, RemoteFile, Source,
                           SourceInfo, check_relpath, sidecar)

log = logging.getLogger("glmflash.provision")
LOCK_NAME = ".glmflash-download.lock"

__all__ = ["DownloadProgress", "download_snapshot", "verify_file"]


@dataclass(frozen=True)
class DownloadProgress:
    """One progress report. `done_bytes`/`total_bytes` count the files fetched by this run (bytes a
    resumed file already had are credited when it completes)."""

    event: Literal["start", "bytes", "file_done", "file_skipped", "done"]
    path: str | None
    done_bytes: int
    total_bytes: int
    done_files: int
    total_files: int


OnProgress = Callable[[DownloadProgress], None]


class _Cancelled(Exception):
    """Raised inside fetches once the download is being torn down."""


def verify_file(path: Path, remote: RemoteFile, source_uri: str = "") -> ManifestFile:
    """Check `path` against what the source published; return its manifest entry.

    Raises ProvisionError naming the file with the expected and the found value.
    """
    where = f" (from {source_uri})" if source_uri else ""
    found_size = path.stat().st_size
    if found_size != remote.size:
        raise ProvisionError(f"{remote.path}: size mismatch: expected {remote.size} bytes, found "
                             f"{found_size} bytes{where}", path=remote.path, source=source_uri or None)
    kind = remote.checksum_kind
    digests = hash_file(path, md5=kind == "md5", etag_part_size=remote.etag_part_size if kind == "etag" else None)
    if kind == "sha256":
        expected, found, verified = remote.checksum, digests.sha256, "sha256"
    elif kind == "md5":
        expected, found, verified = remote.checksum, digests.md5, "md5"
    elif kind == "etag":
        expected, found = remote.checksum, digests.etag
        verified = f"etag-multipart/{remote.etag_part_size}"
    else:
        expected = found = None
        verified = f"size-only: {remote.note or 'the source publishes no checksum'}"
    if expected is not None and (found or "").lower() != expected.lower():
        raise ProvisionError(f"{remote.path}: {kind} mismatch: expected {expected}, found {found}{where}",
                             path=remote.path, source=source_uri or None)
    return ManifestFile(path=remote.path, size=remote.size, checksum=remote.checksum,
                        checksum_kind=remote.checksum_kind, sha256=digests.sha256, verified=verified)


def _entry_matches(entry: ManifestFile, remote: RemoteFile, same_source: bool) -> bool:
    if (entry.size, entry.checksum, entry.checksum_kind) != (remote.size, remote.checksum, remote.checksum_kind):
        return False
    # Without a checksum only the revision ties the bytes to the source.
    return same_source or (remote.checksum is not None)


def _discard_partial(partial: Path) -> None:
    for p in (partial, sidecar(partial, PARTS_SUFFIX), sidecar(partial, WANT_SUFFIX)):
        p.unlink(missing_ok=True)


def _want_record(info: SourceInfo, remote: RemoteFile) -> str:
    rec = {"kind": info.kind, "uri": info.uri, "path": remote.path, "size": remote.size,
           "checksum": remote.checksum, "checksum_kind": remote.checksum_kind}
    if remote.checksum is None:
        rec["revision"] = info.revision
    return json.dumps(rec, sort_keys=True)


def _allocated(path: Path) -> int:
    """Bytes a partial file already occupies on disk (an S3 partial is sparse until its parts land)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else min(st.st_size, blocks * 512)


def download_snapshot(source: Source, dest_dir: str | os.PathLike[str], workers: int = 8,
                      on_progress: OnProgress | None = None, *, verify_existing: bool = False,
                      fsync: bool = True) -> Manifest:
    """Make `dest_dir` a complete, verified copy of `source`'s serving files; return the manifest.

    `workers` files are fetched at once (an S3 source additionally splits files into ranged parts on
    its own pool). `on_progress` is called (serialized) with `DownloadProgress`; if it raises, the
    download stops, leaving everything resumable, and the exception propagates. `verify_existing`
    re-hashes files that would be skipped and refetches those that do not match. `fsync` makes every
    file durable before it is renamed into place.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    with _dir_lock(dest):
        return _download_locked(source, dest, workers, on_progress, verify_existing, fsync)


@contextmanager
def _dir_lock(dest: Path) -> Iterator[None]:
    """One downloader per snapshot directory (an flock, released by the kernel if the process dies)."""
    try:
        import fcntl
    except ImportError:            # not POSIX: no lock
        yield
        return
    fd = os.open(dest / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another download into this directory is running; waiting for it", dest)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _download_locked(source: Source, dest: Path, workers: int, on_progress: OnProgress | None,
                     verify_existing: bool, fsync: bool) -> Manifest:
    info = source.describe()
    files = source.list_files()
    if not files:
        raise ProvisionError(f"{info.uri}@{info.revision}: no snapshot files found (looked for *.json, "
                             "*.safetensors, tokenizer*, *.jinja, *.txt, *.model)", source=info.uri)
    seen: set[str] = set()
    for f in files:
        check_relpath(f.path, info.uri)
        if f.path in seen:
            raise ProvisionError(f"{f.path}: listed twice by {info.uri}", path=f.path, source=info.uri)
        seen.add(f.path)

    try:
        old: Manifest | None = read_manifest(dest)
    except ProvisionError as e:
        old = None
        if (dest / MANIFEST_NAME).exists():
            log.warning("%s; every file will be re-verified or refetched", e)
    same_source = old is not None and old.source == info

    # Files an earlier manifest listed that this listing no longer has (another revision).
    if old is not None:
        for e in old.files:
            if e.path not in seen:
                (dest / e.path).unlink(missing_ok=True)

    old_entries = {e.path: e for e in old.files} if old else {}
    kept: dict[str, ManifestFile] = {}
    todo: list[RemoteFile] = []
    for f in files:
        e = old_entries.get(f.path)
        final = dest / f.path
        if e is not None and _entry_matches(e, f, same_source) and final.is_file() and final.stat().st_size == f.size:
            kept[f.path] = e
        else:
            todo.append(f)
    if verify_existing and kept:
        for problem in verify_hashes(dest, Manifest(info, list(kept.values())), workers):
            log.warning("%s; refetching", problem)
            (dest / problem.path).unlink(missing_ok=True)
            del kept[problem.path]
            todo.append(next(f for f in files if f.path == problem.path))

    manifest = Manifest(source=info, files=[kept[f.path] for f in files if f.path in kept], complete=False,
                        created_at=old.created_at if (same_source and old and old.created_at) else utc_now())
    partial_root = dest / PARTIAL_DIRNAME

    if not todo:
        if not (old is not None and same_source and old.complete and len(old.files) == len(files)):
            _finish(dest, manifest, files, kept)
        else:
            manifest = old
        shutil.rmtree(partial_root, ignore_errors=True)
        _Progress(on_progress, 0, len(files), len(files)).emit("done", None)
        return manifest

    write_manifest(dest, manifest)
    partial_root.mkdir(exist_ok=True)

    need = sum(max(0, f.size - _allocated(partial_root / f.path)) for f in todo)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise ProvisionError(f"{dest}: not enough disk space for {info.uri}: {need} more bytes needed, "
                             f"{free} free")

    state = _Progress(on_progress, total_bytes=sum(f.size for f in todo), total_files=len(files),
                      done_files=len(kept))
    for path in kept:
        state.emit("file_skipped", path)
    state.emit("start", None)

    cancel = threading.Event()

    def job(remote: RemoteFile) -> ManifestFile:
        return _fetch_one(source, info, remote, dest, partial_root, state, cancel, fsync)

    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="glmflash-download")
    futures: list[Future[ManifestFile]] = []
    recorded: set[str] = set()

    def record(fut: Future[ManifestFile]) -> None:
        entry = fut.result()
        if entry.path not in recorded:
            recorded.add(entry.path)
            manifest.files.append(entry)
            write_manifest(dest, manifest)

    try:
        for remote in sorted(todo, key=lambda f: -f.size):      # largest first: shortest makespan
            futures.append(pool.submit(job, remote))
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            ok = [f for f in finished if f.exception() is None]
            for fut in ok:                    # record every success before raising a failure
                record(fut)
            for fut in ok:
                state.emit("file_done", fut.result().path)
            for fut in finished:
                fut.result()
    except BaseException as exc:
        cancel.set()
        for fut in futures:
            fut.cancel()
        pool.shutdown(wait=True)
        for fut in futures:                   # files that landed while shutting down stay recorded
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                record(fut)
        if state.callback_error is not None and exc is not state.callback_error:
            raise state.callback_error from None
        if isinstance(exc, _Cancelled):
            raise ProvisionError(f"download of {info.uri} was cancelled", source=info.uri) from exc
        raise
    pool.shutdown(wait=True)

    _finish(dest, manifest, files, {e.path: e for e in manifest.files})
    shutil.rmtree(partial_root, ignore_errors=True)
    state.emit("done", None)
    return manifest


def _finish(dest: Path, manifest: Manifest, files: list[RemoteFile], entries: dict[str, ManifestFile]) -> None:
    manifest.files = [entries[f.path] for f in files]
    manifest.complete = True
    manifest.completed_at = utc_now()
    write_manifest(dest, manifest)


def _fetch_one(source: Source, info: SourceInfo, remote: RemoteFile, dest: Path, partial_root: Path,
               state: _Progress, cancel: threading.Event, fsync: bool) -> ManifestFile:
    if cancel.is_set():
        raise _Cancelled()
    final = dest / remote.path
    partial = partial_root / remote.path
    partial.parent.mkdir(parents=True, exist_ok=True)

    # A file at the final path without a matching manifest entry: killed between rename and manifest
    # write, or put there by hand. Adopt it when its checksum proves it, else drop it.
    if final.exists():
        if final.is_file() and remote.checksum_kind is not None and final.stat().st_size == remote.size:
            try:
                entry = verify_file(final, remote, info.uri)
                log.info("%s: already in place and verified (%s)", remote.path, entry.verified)
                state.add(remote.path, remote.size)
                return entry
            except ProvisionError:
                pass
        final.unlink()

    want = sidecar(partial, WANT_SUFFIX)
    record = _want_record(info, remote)
    try:
        resumable = want.read_text() == record
    except (FileNotFoundError, UnicodeDecodeError):
        resumable = False
    if not resumable:
        _discard_partial(partial)
        want.write_text(record)
    resumed = resumable and (partial.exists() or sidecar(partial, PARTS_SUFFIX).exists())

    for attempt in (1, 2):
        _fetch(source, info, remote, partial, state, cancel)
        try:
            entry = verify_file(partial, remote, info.uri)
            break
        except ProvisionError:
            if attempt == 1 and resumed:
                log.warning("%s: resumed download failed verification; fetching it again from scratch",
                            remote.path)
                _discard_partial(partial)
                want.write_text(record)
                state.restart(remote.path)
                continue
            _discard_partial(partial)
            raise
    if fsync:
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, final)
    if fsync:
        fsync_dir(final.parent)
    _discard_partial(partial)
    state.add(remote.path, remote.size, final_credit=True)
    return entry


def _fetch(source: Source, info: SourceInfo, remote: RemoteFile, partial: Path, state: _Progress,
           cancel: threading.Event) -> None:
    def progress(n: int) -> None:
        if cancel.is_set():
            raise _Cancelled()
        state.add(remote.path, n)

    try:
        source.fetch(remote, partial, progress)
    except (ProvisionError, _Cancelled):
        raise
    except Exception as e:
        if state.callback_error is not None and e is state.callback_error:
            raise
        raise ProvisionError(f"{remote.path}: fetching from {info.uri} failed: {type(e).__name__}: {e}",
                             path=remote.path, source=info.uri) from e
    if not partial.is_file():
        raise ProvisionError(f"{remote.path}: {type(source).__name__}.fetch wrote nothing", path=remote.path,
                             source=info.uri)


class _Progress:
    """Thread-safe byte and file counters feeding the (serialized) callback."""

    def __init__(self, callback: OnProgress | None, total_bytes: int, total_files: int, done_files: int):
        self.callback = callback
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.done_files = done_files
        self.done_bytes = 0
        self.per_file: dict[str, int] = {}
        self.lock = threading.Lock()
        self.callback_error: BaseException | None = None

    def add(self, path: str, n: int, final_credit: bool = False) -> None:
        """Credit n new bytes of `path`; with `final_credit`, top the file up to `n` bytes in total
        (the part a resumed download already had)."""
        with self.lock:
            have = self.per_file.get(path, 0)
            new = max(have, n) if final_credit else have + n
            self.done_bytes += new - have
            self.per_file[path] = new
            if not final_credit:
                self._emit("bytes", path)

    def restart(self, path: str) -> None:
        with self.lock:
            self.done_bytes -= self.per_file.pop(path, 0)

    def emit(self, event: str, path: str | None) -> None:
        with self.lock:
            if event == "file_done":
                self.done_files += 1
            self._emit(event, path)

    def _emit(self, event: str, path: str | None) -> None:
        if self.callback is None:
            return
        report = DownloadProgress(event, path, self.done_bytes, self.total_bytes,  # type: ignore[arg-type]
                                  self.done_files, self.total_files)
        try:
            self.callback(report)
        except BaseException as e:
            if self.callback_error is None:
                self.callback_error = e
            raise
