"""The on-disk snapshot cache: its manifest, cheap and full checks, and repair.

A snapshot directory holds the files at their relative paths plus `glmflash-manifest.json`:

    {"format_version": 1,
     "source": {"kind": "hf", "uri": "hf://org/name", "revision": "<commit sha>"},
     "files": [{"path": "config.json", "size": 1234, "checksum": "...", "checksum_kind": "sha256",
                "sha256": "<sha256 of the bytes on disk>", "verified": "sha256"}, ...],
     "complete": true, "created_at": "...", "completed_at": "..."}

`files` lists only files that are fully downloaded, verified and in place; `complete` turns true once
every file of the source is. `checksum`/`checksum_kind` are what the source published; `sha256` is
what was hashed at download time (the basis of `verify_hashes` for every source kind); `verified`
says how the download was checked ("sha256", "md5", "etag-multipart/<part size>", or
"size-only: <why>"). Work in progress lives under `.partial/`, never at a final path.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Literal

from .errors import ProvisionError
from .sources.base import MANIFEST_NAME, PARTIAL_DIRNAME, SourceInfo, check_relpath

FORMAT_VERSION = 1
HASH_BLOCK = 8 << 20

__all__ = ["CacheStatus", "FileProblem", "FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "ManifestFile",
           "PARTIAL_DIRNAME", "check_snapshot", "hash_file", "read_manifest", "repair_snapshot",
           "utc_now", "verify_hashes", "write_manifest"]


PREPARED_DIRNAME = "prepared"  # the prepared snapshot, in a model's home


def model_home(cache_dir: Path, spec: str, revision: str | None) -> Path:
    """Where a model's files live in the cache (its downloaded snapshot, prepared snapshot, compiled-kernel
    manifest): named after the source, keyed by source and revision."""
    key = f"{spec}@{revision or ''}"
    readable = "".join(c if c.isalnum() or c in "-_." else "-" for c in spec.rstrip("/").split("/")[-1])[:48]
    return cache_dir / "models" / f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class ManifestFile:
    path: str
    size: int
    checksum: str | None = None
    checksum_kind: str | None = None
    sha256: str | None = None
    verified: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "checksum": self.checksum,
                "checksum_kind": self.checksum_kind, "sha256": self.sha256, "verified": self.verified}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ManifestFile:
        size = d["size"]
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"file {d.get('path')!r} has invalid size {size!r}")
        return cls(path=check_relpath(str(d["path"])), size=size, checksum=d.get("checksum"),
                   checksum_kind=d.get("checksum_kind"), sha256=d.get("sha256"), verified=d.get("verified"))


@dataclass
class Manifest:
    source: SourceInfo
    files: list[ManifestFile] = field(default_factory=list)
    complete: bool = False
    created_at: str = field(default_factory=utc_now)
    completed_at: str | None = None
    format_version: int = FORMAT_VERSION

    def entry(self, path: str) -> ManifestFile | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "source": self.source.to_dict(),
                "files": [f.to_dict() for f in self.files], "complete": self.complete,
                "created_at": self.created_at, "completed_at": self.completed_at}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"format_version {version!r} (this build reads {FORMAT_VERSION})")
        files = [ManifestFile.from_dict(f) for f in d["files"]]
        if len({f.path for f in files}) != len(files):
            raise ValueError("duplicate file paths")
        return cls(source=SourceInfo.from_dict(d["source"]), files=files, complete=bool(d["complete"]),
                   created_at=str(d.get("created_at") or ""), completed_at=d.get("completed_at"),
                   format_version=version)


def read_manifest(snapshot_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of `snapshot_dir`; ProvisionError when absent or unreadable."""
    path = Path(snapshot_dir) / MANIFEST_NAME
    try:
        return Manifest.from_dict(json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise ProvisionError(f"{path}: no manifest (snapshot not downloaded)") from e
    except (ValueError, KeyError, TypeError, AttributeError, ProvisionError) as e:
        raise ProvisionError(f"{path}: unreadable manifest: {e}") from e


def write_manifest(snapshot_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Atomically replace the manifest (temp file, fsync, rename, fsync of the directory)."""
    d = Path(snapshot_dir)
    data = (json.dumps(manifest.to_dict(), indent=1) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(d)


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- checks -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileProblem:
    path: str
    message: str          # names the file and the expected vs found value

    def __str__(self) -> str:
        return self.message


State = Literal["complete", "partial", "corrupt", "missing", "stale"]


@dataclass
class CacheStatus:
    state: State
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    bad_files: list[str] = field(default_factory=list)    # paths a repair should remove

    @property
    def ok(self) -> bool:
        return self.state == "complete"


def _size_problem(snapshot_dir: Path, entry: ManifestFile) -> FileProblem | None:
    try:
        found = (snapshot_dir / entry.path).stat().st_size
    except FileNotFoundError:
        return FileProblem(entry.path, f"{entry.path}: missing (manifest lists {entry.size} bytes)")
    if found != entry.size:
        return FileProblem(entry.path, f"{entry.path}: size mismatch: manifest lists {entry.size} bytes, "
                                       f"found {found} bytes")
    return None


def check_snapshot(snapshot_dir: str | os.PathLike[str], expected_source: SourceInfo | None = None) -> CacheStatus:
    """Cheap check (stat only): manifest readable, every listed file present with its size, the
    `complete` flag, and (when given) the source and revision.

    missing: no directory or no manifest. corrupt: unreadable manifest, or a listed file missing or of
    the wrong size. stale: made from another source or revision than `expected_source`. partial:
    download not finished. complete: none of these.
    """
    d = Path(snapshot_dir)
    if not (d / MANIFEST_NAME).is_file():
        what = "directory does not exist" if not d.is_dir() else f"no {MANIFEST_NAME}"
        return CacheStatus("missing", [f"{d}: {what}"])
    try:
        manifest = read_manifest(d)
    except ProvisionError as e:
        return CacheStatus("corrupt", [str(e)])
    if expected_source is not None and manifest.source != expected_source:
        return CacheStatus("stale", [f"{d}: holds {manifest.source}, expected {expected_source}"], manifest)
    problems = [p for p in (_size_problem(d, e) for e in manifest.files) if p is not None]
    if problems:
        return CacheStatus("corrupt", [str(p) for p in problems], manifest, [p.path for p in problems])
    if not manifest.complete:
        return CacheStatus("partial", [f"{d}: download of {manifest.source} not finished "
                                       f"({len(manifest.files)} files done)"], manifest)
    return CacheStatus("complete", [], manifest)


@dataclass(frozen=True)
class Digests:
    sha256: str
    md5: str | None = None
    etag: str | None = None     # multipart form "<md5 of part md5s>-<n>"


def hash_file(path: str | os.PathLike[str], *, md5: bool = False, etag_part_size: int | None = None) -> Digests:
    """One read pass: sha256 always, the whole-file md5 and/or the multipart ETag when asked."""
    sha = hashlib.sha256()
    whole = hashlib.md5(usedforsecurity=False) if md5 else None
    part = hashlib.md5(usedforsecurity=False) if etag_part_size else None
    part_digests: list[bytes] = []
    left = etag_part_size or 0
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            want = HASH_BLOCK if part is None else min(HASH_BLOCK, left)
            n = f.readinto(view[:want])
            if not n:
                break
            chunk = view[:n]
            sha.update(chunk)
            if whole is not None:
                whole.update(chunk)
            if part is not None:
                part.update(chunk)
                left -= n
                if left == 0:
                    part_digests.append(part.digest())
                    part = hashlib.md5(usedforsecurity=False)
                    left = etag_part_size or 0
    etag = None
    if etag_part_size:
        if left != etag_part_size or not part_digests:
            part_digests.append(part.digest())  # type: ignore[union-attr]
        etag = hashlib.md5(b"".join(part_digests), usedforsecurity=False).hexdigest() + f"-{len(part_digests)}"
    return Digests(sha.hexdigest(), whole.hexdigest() if whole else None, etag)


def _expected_sha256(entry: ManifestFile) -> str | None:
    if entry.sha256:
        return entry.sha256
    return entry.checksum if entry.checksum_kind == "sha256" else None


def _verify_one(d: Path, entry: ManifestFile) -> FileProblem | None:
    problem = _size_problem(d, entry)
    if problem is not None:
        return problem
    want = _expected_sha256(entry)
    if want is None:
        return FileProblem(entry.path, f"{entry.path}: manifest has no sha256 to verify against")
    found = hash_file(d / entry.path).sha256
    if found != want:
        return FileProblem(entry.path, f"{entry.path}: sha256 mismatch: expected {want}, found {found}")
    return None


def verify_hashes(snapshot_dir: str | os.PathLike[str], manifest: Manifest | None = None,
                  workers: int = 8) -> list[FileProblem]:
    """Re-hash every listed file (in parallel) against the sha256 recorded at download time.

    Returns the problems (empty when all match), each naming the file and expected vs found value.
    """
    d = Path(snapshot_dir)
    manifest = manifest if manifest is not None else read_manifest(d)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="glmflash-verify") as pool:
        results = list(pool.map(lambda e: _verify_one(d, e), manifest.files))
    return [p for p in results if p is not None]


def repair_snapshot(snapshot_dir: str | os.PathLike[str], bad: Iterable[str | FileProblem] | None = None,
                    *, workers: int = 8) -> list[str]:
    """Remove bad files and their manifest entries so the next download refetches only them.

    `bad` defaults to everything the cheap check and a full re-hash find. The manifest is rewritten
    with `complete=False`. Returns the removed paths. An unreadable manifest is removed as a whole
    (the next download then re-verifies or refetches every file).
    """
    d = Path(snapshot_dir)
    try:
        manifest = read_manifest(d)
    except ProvisionError:
        (d / MANIFEST_NAME).unlink(missing_ok=True)
        return []
    if bad is None:
        problems = verify_hashes(d, manifest, workers)
        paths = {p.path for p in problems}
    else:
        paths = {b.path if isinstance(b, FileProblem) else str(b) for b in bad}
    listed = {f.path for f in manifest.files}
    removed = []
    for path in sorted(paths):
        check_relpath(path)
        (d / path).unlink(missing_ok=True)
        if path in listed:
            removed.append(path)
    if removed or (paths and manifest.complete):
        manifest.files = [f for f in manifest.files if f.path not in paths]
        manifest.complete = False
        manifest.completed_at = None
        write_manifest(d, manifest)
    return removed
