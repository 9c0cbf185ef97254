"""Snapshot sources: a local directory, an s3:// prefix, or a Hugging Face repository."""

from __future__ import annotations

from pathlib import Path

from ..errors import ProvisionError
from .base import (MANIFEST_NAME, PARTIAL_DIRNAME, ProgressFn, RemoteFile, Source, SourceInfo,
                   is_snapshot_file)
from .huggingface import HuggingFaceSource, parse_hf_spec
from .local import LocalSource
from .s3 import DEFAULT_PART_SIZE, S3Source, parse_s3_uri

__all__ = ["DEFAULT_PART_SIZE", "HuggingFaceSource", "LocalSource", "MANIFEST_NAME", "PARTIAL_DIRNAME",
           "ProgressFn", "RemoteFile", "S3Source", "Source", "SourceInfo", "is_snapshot_file",
           "parse_hf_spec", "parse_s3_uri", "source_for"]

_PATH_STARTS = ("/", "./", "../", "~", ".\\", "..\\")


def source_for(spec: str, *, revision: str | None = None, token: str | None = None,
               endpoint_url: str | None = None, workers: int = 8) -> Source:
    """The source a spec names.

    - `s3://bucket/prefix` -> S3Source (at `endpoint_url`, `workers` parallel GETs)
    - an existing directory, or anything spelled as a path (`/x`, `./x`, `../x`, `~/x`) -> LocalSource
    - `org/name[@revision]` (or `hf://org/name[@revision]`) -> HuggingFaceSource (with `token`); the revision
      is the one after '@', else the pinned `revision`, else "main"; both given and different is an error.
    """
    text = (spec or "").strip()
    if not text:
        raise ProvisionError("no model source given (set GLMFLASH_MODEL or GLMFLASH_S3_URI)")
    if text.startswith("s3://"):
        return S3Source(text, endpoint_url=endpoint_url, workers=workers)
    if not text.startswith("hf://"):
        path = Path(text).expanduser()
        if path.is_dir():
            return LocalSource(path)
        if path.exists():
            raise ProvisionError(f"model source {text} is a file, not a snapshot directory", source=text)
        if text.startswith(_PATH_STARTS) or text.count("/") > 1:
            raise ProvisionError(f"local snapshot directory {text} does not exist", source=text)
    try:
        repo_id, asked = parse_hf_spec(text)
    except ProvisionError as e:
        raise ProvisionError(f"model source {spec!r} is neither an existing directory, an s3:// URI nor a "
                             f"Hugging Face id org/name[@revision] ({e})", source=spec) from e
    if asked and revision and asked != revision:
        raise ProvisionError(f"{spec!r} asks for revision {asked!r} but GLMFLASH_MODEL_REVISION is "
                             f"{revision!r}; set only one", source=spec)
    return HuggingFaceSource(repo_id, asked or revision, token=token)
