"""A Hugging Face model repository, pinned to one commit.

`describe()` resolves the requested revision (branch, tag or sha; default "main") to its commit sha
once, with `HfApi.model_info(files_metadata=True)`; every later listing and download uses that sha,
so a branch moving mid-download cannot mix two commits.

Fetching streams `resolve/<sha>/<path>` with `huggingface_hub.file_download.http_get`, appending to
the partial file from its current size (the library sends the Range header, follows the redirect
to the CDN, retries transient errors and falls back to a full download when a server ignores the
Range). `hf_hub_download(local_dir=...)` is not used: since huggingface_hub 1.x it downloads into a
process-unique temporary file that is deleted on failure, so an interrupted download restarts from
zero, and the partial bytes never reach the path the orchestrator manages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import ProvisionError
from .base import ProgressFn, RemoteFile, Source, SourceInfo, check_relpath, is_snapshot_file

_SHA = re.compile(r"^[0-9a-f]{40}$")
_BLOB_NOTE = "not an LFS file: its git blob id is kept as a revision marker only"


def parse_hf_spec(spec: str) -> tuple[str, str | None]:
    """'org/name[@revision]' (optionally 'hf://'-prefixed) -> (repo_id, revision or None).

    The revision is everything after the first '@' (branches like 'refs/pr/3' contain '/').
    """
    text = spec.strip()
    if text.startswith("hf://"):
        text = text[len("hf://"):]
    repo_id, sep, revision = text.partition("@")
    if sep and not revision:
        raise ProvisionError(f"Hugging Face id {spec!r} has an empty revision after '@'", source=spec)
    if repo_id.count("/") != 1:
        raise ProvisionError(f"{spec!r} is not a Hugging Face id of the form org/name[@revision]", source=spec)
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except Exception as e:  # HFValidationError
        raise ProvisionError(f"{spec!r} is not a valid Hugging Face id: {e}", source=spec) from e
    return repo_id, (revision or None)


class HuggingFaceSource(Source):
    kind = "hf"

    def __init__(self, repo_id: str, revision: str | None = None, *, token: str | None = None,
                 endpoint: str | None = None):
        self.repo_id = repo_id
        self.requested_revision = revision or "main"
        self.token = token
        self.endpoint = endpoint
        self.uri = f"hf://{repo_id}"
        self._info: Any = None

    def _model_info(self) -> Any:
        if self._info is None:
            from huggingface_hub import HfApi

            try:
                self._info = HfApi(endpoint=self.endpoint, token=self.token, library_name="glmflash").model_info(
                    self.repo_id, revision=self.requested_revision, files_metadata=True)
            except Exception as e:
                raise ProvisionError(f"cannot resolve {self.uri}@{self.requested_revision}: {_hub_error(e)}",
                                     source=self.uri) from e
            if not getattr(self._info, "sha", None):
                raise ProvisionError(f"{self.uri}@{self.requested_revision}: the hub returned no commit sha",
                                     source=self.uri)
        return self._info

    def describe(self) -> SourceInfo:
        return SourceInfo(kind=self.kind, uri=self.uri, revision=self._model_info().sha)

    def list_files(self) -> list[RemoteFile]:
        return files_from_siblings(self._model_info().siblings or [], self.uri)

    def fetch(self, file: RemoteFile, dest: Path, progress: ProgressFn) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        sha = self.describe().revision
        url = hf_hub_url(self.repo_id, file.path, revision=sha, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token, library_name="glmflash")
        with open(dest, "ab") as f:
            have = f.tell()
            if have > file.size:                    # not a prefix of this file: start over
                f.truncate(0)
                have = 0
            if have == file.size:
                return
            from_callback: list[BaseException] = []

            def forward(n: int) -> None:
                try:
                    progress(n)
                except BaseException as e:     # the caller's cancellation: pass it through unwrapped
                    from_callback.append(e)
                    raise

            try:
                http_get(url, f, resume_size=have, headers=headers, expected_size=file.size,
                         displayed_filename=file.path, tqdm_class=_progress_bar(forward))
            except ProvisionError:
                raise
            except Exception as e:
                if from_callback and e is from_callback[0]:
                    raise
                raise ProvisionError(f"{file.path}: download from {self.uri}@{sha} failed: {_hub_error(e)}",
                                     path=file.path, source=self.uri) from e


def files_from_siblings(siblings: list[Any], uri: str) -> list[RemoteFile]:
    """RemoteFiles for the serving files among a ModelInfo's siblings (LFS: sha256; else git blob id)."""
    out = []
    for s in siblings:
        path = s.rfilename
        if not is_snapshot_file(path):
            continue
        check_relpath(path, uri)
        lfs = s.lfs
        lfs_sha = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
        lfs_size = (lfs.get("size") if isinstance(lfs, dict) else getattr(lfs, "size", None)) if lfs else None
        size = s.size if s.size is not None else lfs_size
        if size is None:
            raise ProvisionError(f"{path}: {uri} lists no size for it (model_info without files_metadata?)",
                                 path=path, source=uri)
        if lfs_sha:
            out.append(RemoteFile(path, int(size), lfs_sha, "sha256"))
        else:
            out.append(RemoteFile(path, int(size), s.blob_id, None, note=_BLOB_NOTE))
    return sorted(out, key=lambda f: f.path)


def _progress_bar(progress: ProgressFn) -> type:
    """A tqdm stand-in for `http_get` that forwards byte counts (and shows nothing)."""

    class _Bar:
        def __init__(self, *args: Any, **kwargs: Any):
            pass

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            if n:
                progress(int(n))

        def close(self) -> None:
            pass

    return _Bar


def _hub_error(e: Exception) -> str:
    name = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    hint = ""
    if name in ("GatedRepoError", "RepositoryNotFoundError") or "401" in text or "403" in text:
        hint = " (private or gated repository? set HF_TOKEN)"
    elif name == "RevisionNotFoundError":
        hint = " (check GLMFLASH_MODEL_REVISION / the @revision)"
    elif name == "OfflineModeIsEnabled":
        hint = " (HF_HUB_OFFLINE is set)"
    return f"{name}: {text}{hint}"
