"""Shared helpers for the provisioning tests (fake snapshots, S3 uploads, GET counting)."""

from __future__ import annotations

import socket
from pathlib import Path

SERVING = {
    "config.json": b'{"model_type": "glm5_next", "hidden_size": 64}\n',
    "generation_config.json": b'{"eos_token_id": [1, 2]}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": b'{"chat_template": null}\n',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}\n",
    "model.safetensors.index.json": b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}\n',
}
SKIPPED = {
    "README.md": b"# model card\n",
    "images/logo.png": b"\x89PNG....",
    "original/consolidated.safetensors": b"x" * 1000,
}
BIG = "model-00001-of-00002.safetensors"
SMALL = "model-00002-of-00002.safetensors"


def snapshot_bytes(seed: int = 0, big_size: int = 3 * (1 << 20) + 12345) -> dict[str, bytes]:
    """Serving files (incl. a >1 MB shard) plus files a serving snapshot must skip."""
    import random

    rng = random.Random(seed)
    files = dict(SERVING)
    files[BIG] = rng.randbytes(big_size)
    files[SMALL] = rng.randbytes(200_000)
    files.update(SKIPPED)
    return files


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def serving_only(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k not in SKIPPED}


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every regular file under root except the manifest and hidden bookkeeping (.partial/, the lock)."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != "glmflash-manifest.json" and not rel.startswith("."):
            out[rel] = p.read_bytes()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upload(s3, bucket: str, prefix: str, files: dict[str, bytes], multipart: dict[str, list[int]] | None = None):
    """put_object each file; files named in `multipart` are uploaded in parts of the given sizes."""
    multipart = multipart or {}
    for rel, data in files.items():
        key = f"{prefix}/{rel}" if prefix else rel
        sizes = multipart.get(rel)
        if not sizes:
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            continue
        up = s3.create_multipart_upload(Bucket=bucket, Key=key)
        parts, off = [], 0
        for i, n in enumerate(sizes, start=1):
            chunk = data[off:] if i == len(sizes) else data[off:off + n]
            off += len(chunk)
            r = s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=i, Body=chunk)
            parts.append({"ETag": r["ETag"], "PartNumber": i})
        assert off == len(data)
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})


class GetLog:
    """Counts the GETs an S3 client makes, through a botocore event hook."""

    def __init__(self, client):
        self.calls: list[tuple[str, str]] = []
        client.meta.events.register("provide-client-params.s3.GetObject", self._hook)

    def _hook(self, params, **_):
        self.calls.append((params["Key"], params.get("Range", "")))

    def for_key(self, suffix: str) -> list[str]:
        return [rng for key, rng in self.calls if key.endswith("/" + suffix) or key == suffix]
