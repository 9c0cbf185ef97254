"""A snapshot directory on this machine (a mounted volume, an HF cache snapshot, a test fixture)."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from ..errors import ProvisionError
from .base import ProgressFn, RemoteFile, Source, SourceInfo, is_snapshot_file

_FICLONE = 0x40049409          # linux/fs.h: share extents (reflink) on btrfs/XFS/bcachefs
_CHUNK = 64 << 20
_NOTE = "a local directory publishes no checksums"


class LocalSource(Source):
    """A snapshot directory on this machine. Starts read it in place (`worker.provisioning`): its
    listing and `describe()` (names, sizes, mtimes) say what it holds, and nothing is copied.

    `fetch` (for `download_snapshot`, to mirror a directory into a cache) copies files out of `root`:
    a reflink when the filesystem offers one, else a kernel-side `copy_file_range` (plain read/write
    as the last resort), continuing from the partial file's size. Files are never hardlinked: a
    cache must not share an inode with the source, or repairing (or corrupting) one would change
    the other.
    """

    kind = "local"

    def __init__(self, root: str | os.PathLike[str], *, chunk_size: int = _CHUNK, reflink: bool = True):
        self.root = Path(root).expanduser().resolve()
        self.chunk_size = max(1, int(chunk_size))
        self.reflink = reflink
        if not self.root.is_dir():
            raise ProvisionError(f"local snapshot directory {self.root} does not exist", source=str(self.root))
        self._scan: list[tuple[str, int, int]] | None = None

    def _entries(self) -> list[tuple[str, int, int]]:
        if self._scan is None:
            found: list[tuple[str, int, int]] = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    full = Path(dirpath, name)
                    rel = full.relative_to(self.root).as_posix()
                    if not is_snapshot_file(rel):
                        continue
                    try:
                        st = full.stat()          # follows symlinks (HF cache snapshots are links)
                    except FileNotFoundError:
                        continue                  # dangling link
                    found.append((rel, st.st_size, st.st_mtime_ns))
            self._scan = sorted(found)
        return self._scan

    def describe(self) -> SourceInfo:
        digest = hashlib.sha256()
        for rel, size, mtime in self._entries():
            digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
        return SourceInfo(kind=self.kind, uri=str(self.root), revision="local-" + digest.hexdigest()[:40])

    def list_files(self) -> list[RemoteFile]:
        return [RemoteFile(rel, size, note=_NOTE) for rel, size, _ in self._entries()]

    def fetch(self, file: RemoteFile, dest: Path, progress: ProgressFn) -> None:
        src = self.root / file.path
        try:
            src_fd = os.open(src, os.O_RDONLY)
        except OSError as e:
            raise ProvisionError(f"{file.path}: cannot open {src}: {e.strerror}", path=file.path,
                                 source=str(self.root)) from e
        try:
            size = os.fstat(src_fd).st_size
            if size != file.size:
                raise ProvisionError(f"{file.path}: changed in {self.root} while downloading: listed {file.size} "
                                     f"bytes, now {size} bytes", path=file.path, source=str(self.root))
            dst_fd = os.open(dest, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                have = os.fstat(dst_fd).st_size
                if have > size:
                    os.ftruncate(dst_fd, 0)
                    have = 0
                if have == 0 and size > 0 and self.reflink and _reflink(src_fd, dst_fd):
                    progress(size)
                    return
                _copy_range(src_fd, dst_fd, have, size, progress, file.path, self.chunk_size)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)


def _reflink(src_fd: int, dst_fd: int) -> bool:
    try:
        import fcntl

        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except (OSError, ImportError):
        return False


def _copy_range(src_fd: int, dst_fd: int, start: int, end: int, progress: ProgressFn, path: str,
                chunk: int) -> None:
    off = start
    use_cfr = hasattr(os, "copy_file_range")
    while off < end:
        n = 0
        if use_cfr:
            try:
                n = os.copy_file_range(src_fd, dst_fd, min(chunk, end - off), off, off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                use_cfr = False
                continue
            if n == 0:          # some filesystems return 0 instead of an error: fall back
                use_cfr = False
                continue
        else:
            buf = os.pread(src_fd, min(chunk, end - off), off)
            if not buf:
                raise ProvisionError(f"{path}: source file ended at {off} bytes, expected {end} bytes", path=path)
            n = 0
            while n < len(buf):
                n += os.pwrite(dst_fd, memoryview(buf)[n:], off + n)
        off += n
        progress(n)
