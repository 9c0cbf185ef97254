"""A snapshot under an S3 (or S3-compatible: MinIO, R2, ...) prefix, fetched with parallel ranged GETs.

Resume design: a file is fetched as fixed-size parts (`part_size`, 64 MiB by default) into a file
sized to its full length up front; each part is written at its offset with `os.pwrite`. After a
part's bytes are all written its index is appended to a sidecar (`<dest>.glmflash-parts`, first line
a JSON header with the object's ETag, size and the part size). A killed download leaves the data
file and the sidecar; the next `fetch` reads the sidecar and GETs only the parts not listed there.
A sidecar whose header does not match the object (new ETag, other part size) or a data file of the
wrong size means a fresh start. Every GET carries `If-Match: <etag>`, so an object replaced during
the download fails loudly instead of mixing two versions.

Part GETs of all files share one pool of `workers` threads (the global bound on connections), so
the orchestrator can run several files at once without multiplying connections.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path
from typing import Any

from ..errors import ProvisionError
from .base import PARTS_SUFFIX, ProgressFn, RemoteFile, Source, SourceInfo, check_relpath, is_snapshot_file, sidecar

log = logging.getLogger("glmflash.provision")

DEFAULT_PART_SIZE = 64 << 20
_READ_CHUNK = 1 << 20
_STREAM_ATTEMPTS = 5
_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-(\d+)$")
_PLAIN_ETAG = re.compile(r"^[0-9a-f]{32}$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix/' -> ('bucket', 'some/prefix')."""
    if not uri.startswith("s3://"):
        raise ProvisionError(f"not an s3:// URI: {uri!r}", source=uri)
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ProvisionError(f"s3 URI {uri!r} has no bucket", source=uri)
    return bucket, prefix.strip("/")


class S3Source(Source):
    kind = "s3"

    def __init__(self, uri: str, *, endpoint_url: str | None = None, workers: int = 8,
                 part_size: int = DEFAULT_PART_SIZE, client: Any = None):
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.endpoint_url = endpoint_url
        self.workers = max(1, int(workers))
        if part_size < 1:
            raise ProvisionError(f"{self.uri}: part size must be positive, got {part_size}", source=self.uri)
        self.part_size = int(part_size)
        self._client = client
        self._client_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._listing: list[tuple[str, str, int, str]] | None = None   # (path, key, size, etag)
        self._files: list[RemoteFile] | None = None
        self._keys: dict[str, tuple[str, str]] = {}                     # path -> (key, etag)

    # -- plumbing -------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore import UNSIGNED
                from botocore.config import Config

                session = boto3.session.Session()
                cfg: dict[str, Any] = dict(max_pool_connections=self.workers + 8,
                                           retries={"mode": "standard", "max_attempts": 6})
                if session.get_credentials() is None:        # public bucket: anonymous requests
                    cfg["signature_version"] = UNSIGNED
                self._client = session.client("s3", endpoint_url=self.endpoint_url, config=Config(**cfg))
            return self._client

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._client_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="glmflash-s3")
            return self._pool

    def close(self) -> None:
        with self._client_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _error(self, what: str, exc: Exception, path: str | None = None) -> ProvisionError:
        detail = _client_error_text(exc)
        where = f"{path}: " if path else ""
        return ProvisionError(f"{where}{what} {self.uri} failed: {detail}", path=path, source=self.uri)

    # -- listing --------------------------------------------------------------------------------
    def _list(self) -> list[tuple[str, str, int, str]]:
        if self._listing is None:
            list_prefix = f"{self.prefix}/" if self.prefix else ""
            out = []
            try:
                for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                  Prefix=list_prefix):
                    for obj in page.get("Contents", []):
                        key = obj["Key"]
                        if key.endswith("/"):
                            continue                      # "directory" marker
                        rel = key[len(list_prefix):]
                        if not is_snapshot_file(rel):
                            continue
                        check_relpath(rel, self.uri)
                        out.append((rel, key, int(obj["Size"]), obj["ETag"].strip('"')))
            except ProvisionError:
                raise
            except Exception as e:
                raise self._error("listing", e) from e
            self._listing = sorted(out)
            self._keys = {rel: (key, etag) for rel, key, _, etag in self._listing}
        return self._listing

    def describe(self) -> SourceInfo:
        digest = hashlib.sha256()
        for rel, _key, size, etag in self._list():
            digest.update(f"{rel}\0{size}\0{etag}\n".encode())
        return SourceInfo(kind=self.kind, uri=self.uri, revision="s3-" + digest.hexdigest()[:40])

    def list_files(self) -> list[RemoteFile]:
        if self._files is None:
            listing = self._list()
            self._files = list(self.pool.map(lambda item: self._remote_file(*item), listing))
        return list(self._files)

    def _remote_file(self, rel: str, key: str, size: int, etag: str) -> RemoteFile:
        """Classify the ETag; a HEAD (with PartNumber=1) tells encryption and the upload's part size."""
        head = self._head(key, rel)
        if head.get("SSECustomerAlgorithm") or str(head.get("ServerSideEncryption", "")).startswith("aws:kms"):
            return RemoteFile(rel, size, etag, None,
                              note="encrypted with SSE-KMS/SSE-C, so its ETag is not an MD5")
        if _PLAIN_ETAG.match(etag):
            return RemoteFile(rel, size, etag, "md5")
        m = _MULTIPART_ETAG.match(etag)
        if m:
            parts = int(m.group(1))
            part_size = head.get("_part1_size")
            if part_size and head.get("PartsCount") == parts and math.ceil(size / part_size) == parts:
                return RemoteFile(rel, size, etag, "etag", etag_part_size=int(part_size))
            return RemoteFile(rel, size, etag, None,
                              note=f"multipart ETag ({parts} parts) whose part layout cannot be reconstructed "
                                   "(non-uniform part sizes, or the endpoint has no HEAD ?partNumber)")
        return RemoteFile(rel, size, etag, None, note=f"ETag {etag!r} is neither an MD5 nor a multipart ETag")

    def _head(self, key: str, rel: str) -> dict[str, Any]:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key, PartNumber=1)
            head["_part1_size"] = int(head["ContentLength"])
            return head
        except Exception as first:     # some S3-compatibles reject PartNumber on HEAD
            try:
                return self.client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                raise self._error("HEAD of", e, rel) from first

    # -- fetching -------------------------------------------------------------------------------
    def fetch(self, file: RemoteFile, dest: Path, progress: ProgressFn) -> None:
        self._list()
        if file.path not in self._keys:
            raise ProvisionError(f"{file.path}: not in {self.uri}", path=file.path, source=self.uri)
        key, etag = self._keys[file.path]
        size, part_size = file.size, self.part_size
        n_parts = math.ceil(size / part_size)
        parts_path = sidecar(dest, PARTS_SUFFIX)
        header = {"etag": etag, "size": size, "part_size": part_size}

        done = _read_parts(parts_path, header, n_parts)
        if done is None or not dest.is_file() or dest.stat().st_size != size:
            parts_path.unlink(missing_ok=True)
            with open(dest, "wb") as f:
                f.truncate(size)                         # sized (sparse) up front; parts land by offset
            with open(parts_path, "w") as f:
                f.write(json.dumps(header) + "\n")
            done = set()
        elif done:
            log.info("%s: resuming, %d of %d parts already fetched", file.path, len(done), n_parts)
        todo = [i for i in range(n_parts) if i not in done]
        if not todo:
            return

        abort = threading.Event()
        record_lock = threading.Lock()
        fd = os.open(dest, os.O_WRONLY)
        rec = os.open(parts_path, os.O_WRONLY | os.O_APPEND)
        try:
            def one(i: int) -> int:
                if abort.is_set():
                    return 0
                start = i * part_size
                end = min(size, start + part_size) - 1
                self._get_range(file.path, key, etag, start, end, size, fd, abort)
                with record_lock:
                    os.write(rec, f"{i}\n".encode())
                return end - start + 1

            futures: list[Future[int]] = [self.pool.submit(one, i) for i in todo]
            try:
                for fut in as_completed(futures):
                    n = fut.result()
                    if n:
                        progress(n)
            except BaseException:
                abort.set()
                for fut in futures:
                    fut.cancel()
                wait(futures)
                raise
        finally:
            os.close(rec)
            os.close(fd)

    def _get_range(self, path: str, key: str, etag: str, start: int, end: int, size: int, fd: int,
                   abort: threading.Event) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        off, attempts = start, 0
        while off <= end:
            if abort.is_set():
                raise ProvisionError(f"{path}: download aborted", path=path, source=self.uri)
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={off}-{end}",
                                              IfMatch=f'"{etag}"')
                _check_range(resp, off, end, size, path, self.uri)
                for chunk in resp["Body"].iter_chunks(_READ_CHUNK):
                    if off + len(chunk) > end + 1:
                        raise ProvisionError(f"{path}: {self.uri} sent more bytes than the range "
                                             f"{start}-{end} asked for", path=path, source=self.uri)
                    view, written = memoryview(chunk), 0
                    while written < len(chunk):
                        written += os.pwrite(fd, view[written:], off + written)
                    off += len(chunk)
                    attempts = 0
                if off <= end:
                    raise _ShortRead(f"stream ended at byte {off}, range ends at {end}")
            except ProvisionError:
                raise
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code == "PreconditionFailed" or status == 412:
                    raise ProvisionError(f"{path}: {self.uri}/{path} changed while downloading (its ETag is no "
                                         f"longer {etag}); run again to fetch the new version",
                                         path=path, source=self.uri) from e
                raise self._error(f"GET bytes {off}-{end} of", e, path) from e
            except (BotoCoreError, OSError, _ShortRead) as e:
                attempts += 1
                if attempts >= _STREAM_ATTEMPTS:
                    raise self._error(f"GET bytes {off}-{end} (after {attempts} attempts) of", e, path) from e
                log.warning("%s: GET bytes %d-%d interrupted (%s), retrying", path, off, end, e)


class _ShortRead(Exception):
    pass


def _check_range(resp: dict[str, Any], off: int, end: int, size: int, path: str, uri: str) -> None:
    """The body must start at `off`: a server that ignores Range would otherwise shift the bytes."""
    content_range = resp.get("ContentRange")
    if content_range:
        m = re.match(r"bytes (\d+)-(\d+)/", content_range)
        if m and int(m.group(1)) == off and int(m.group(2)) <= end:
            return
    elif off == 0 and end == size - 1 and resp.get("ContentLength") == size:
        return                                                      # whole object, plain 200
    raise ProvisionError(f"{path}: {uri} answered a GET for bytes {off}-{end} with "
                         f"Content-Range {content_range!r}: the endpoint does not honour Range",
                         path=path, source=uri)


def _read_parts(path: Path, header: dict[str, Any], n_parts: int) -> set[int] | None:
    """Finished parts recorded in the sidecar, or None when there is no usable sidecar."""
    try:
        # Only newline-terminated lines count: a record torn by a crash mid-append is ignored.
        lines = path.read_text().split("\n")[:-1]
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    if not lines:
        return None
    try:
        if json.loads(lines[0]) != header:
            return None
    except ValueError:
        return None
    done = set()
    for line in lines[1:]:
        if line.isdigit() and int(line) < n_parts:
            done.add(int(line))
    return done


def _client_error_text(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        err = response["Error"]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{err.get('Code', '?')} ({status}): {err.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"
