"""The source interface: where a snapshot comes from, which files it has, and how one is fetched.

A source knows files and bytes only. The download orchestrator (`provision.download`) decides what
to fetch, verifies it and moves it into place; a source's `fetch` only has to write the right bytes
into the path it is given, continuing from whatever an interrupted run left there.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

from ..errors import ProvisionError

MANIFEST_NAME = "glmflash-manifest.json"
PARTIAL_DIRNAME = ".partial"
# Sidecars next to a file under .partial/ (suffixes no snapshot file has).
PARTS_SUFFIX = ".glmflash-parts"   # S3: finished ranged parts
WANT_SUFFIX = ".glmflash-want"     # orchestrator: which remote file this partial belongs to

ChecksumKind = Literal["sha256", "etag", "md5"]
ProgressFn = Callable[[int], None]
"""Called with the number of new bytes written (may be called from the fetching thread only)."""

# What a serving snapshot needs. Everything else in a repository (README, images, original/
# checkpoints in another format, .bin duplicates, code) is skipped.
SNAPSHOT_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")
SKIP_DIRS = frozenset({"original", "images", "imgs", "img", "assets", "figures", "docs", "examples"})
SKIP_NAME_PREFIXES = ("readme", "glmflash-")


def is_snapshot_file(path: str) -> bool:
    """Whether `path` (relative, '/'-separated) belongs in a serving snapshot."""
    parts = path.split("/")
    if any(not p or p.startswith(".") for p in parts):        # .git, .cache, .partial, empty parts
        return False
    if any(p.lower() in SKIP_DIRS for p in parts[:-1]):
        return False
    name = parts[-1].lower()
    if name.startswith(SKIP_NAME_PREFIXES):
        return False
    return name.startswith("tokenizer") or name.endswith(SNAPSHOT_SUFFIXES)


def check_relpath(path: str, source: str | None = None) -> str:
    """Reject paths that would land outside the snapshot directory; returns the path unchanged."""
    norm = posixpath.normpath(path)
    if (not path or path.startswith("/") or "\\" in path or norm != path or norm == "."
            or norm.startswith("../") or norm == ".."):
        raise ProvisionError(f"unsafe file path {path!r}" + (f" in {source}" if source else ""),
                             path=path, source=source)
    return path


@dataclass(frozen=True)
class SourceInfo:
    """Identity of a snapshot: `revision` is always concrete (a commit sha or a listing digest)."""

    kind: str        # "hf" | "s3" | "local"
    uri: str         # hf://org/name, s3://bucket/prefix, /abs/dir
    revision: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SourceInfo:
        return cls(kind=str(data["kind"]), uri=str(data["uri"]), revision=str(data["revision"]))

    def __str__(self) -> str:
        return f"{self.uri}@{self.revision}"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a snapshot as the source lists it.

    `checksum_kind` says how `checksum` can verify the bytes: "sha256" (HF LFS), "md5" (single-part
    S3 ETag), "etag" (multipart S3 ETag, `<md5 of part md5s>-<parts>`, reconstructable with
    `etag_part_size`). When it is None, `checksum` (if any) is only an identity marker (a git blob
    id, an ETag that is not an MD5) and the file is verified by size; `note` says why.
    """

    path: str
    size: int
    checksum: str | None = None
    checksum_kind: ChecksumKind | None = None
    etag_part_size: int | None = None
    note: str | None = None


class Source(ABC):
    """A place a snapshot can be downloaded from."""

    kind: ClassVar[str]

    @abstractmethod
    def describe(self) -> SourceInfo:
        """The source's identity with a concrete revision (resolved once, then pinned)."""

    @abstractmethod
    def list_files(self) -> list[RemoteFile]:
        """The serving files of the pinned revision (see `is_snapshot_file`)."""

    @abstractmethod
    def fetch(self, file: RemoteFile, dest: Path, progress: ProgressFn) -> None:
        """Write `file`'s bytes to `dest`.

        `dest` may already hold what an interrupted run wrote (and sidecars next to it, named
        `dest` + a suffix); continue from there rather than starting over when that is safe.
        Call `progress(n)` as bytes land; if it raises, stop promptly (leaving resumable state)
        and let the exception propagate. Raise `ProvisionError` naming the file on failure.
        """

    def close(self) -> None:
        """Release pools and connections (idempotent)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sidecar(dest: Path, suffix: str) -> Path:
    return dest.with_name(dest.name + suffix)
