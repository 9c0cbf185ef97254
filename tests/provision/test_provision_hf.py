"""Hugging Face source without the hub: spec parsing, file selection, and the download path against a
local HTTP stand-in that speaks the two hub routes the source uses (`/api/models/<id>/revision/<rev>`
for model_info and `/<id>/resolve/<sha>/<path>` with Range). The real hub is only used when
GLMFLASH_TEST_HUB=1 (this machine has no network)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from provision.cache import check_snapshot
from provision.download import download_snapshot
from provision.errors import ProvisionError
from provision.sources import HuggingFaceSource, LocalSource, is_snapshot_file, parse_hf_spec, source_for
from provision.sources.huggingface import files_from_siblings
from provision_helpers import BIG, SMALL, serving_only, snapshot_bytes, tree_bytes
from worker.settings import Settings

REPO = "zai-org/GLM-5.3-Flash"
SHA = "0123456789abcdef0123456789abcdef01234567"


# -- spec parsing and file selection ------------------------------------------------------------------
@pytest.mark.parametrize("spec,repo,rev", [
    ("zai-org/GLM-5.3-Flash", "zai-org/GLM-5.3-Flash", None),
    ("zai-org/GLM-5.3-Flash@main", "zai-org/GLM-5.3-Flash", "main"),
    (f"zai-org/GLM-5.3-Flash@{SHA}", "zai-org/GLM-5.3-Flash", SHA),
    ("hf://org/name@refs/pr/3", "org/name", "refs/pr/3"),
    ("  org/name.v2_x  ", "org/name.v2_x", None),
])
def test_parse_hf_spec(spec, repo, rev):
    assert parse_hf_spec(spec) == (repo, rev)


@pytest.mark.parametrize("spec", ["name-only", "org/name@", "a/b/c", "org/na me", "org/--bad", ""])
def test_parse_hf_spec_rejects(spec):
    with pytest.raises(ProvisionError):
        parse_hf_spec(spec)


def test_source_for_dispatch(tmp_path, monkeypatch):
    s = dict(token="hf_x", revision=None)
    hf = source_for("zai-org/GLM-5.3-Flash@v1", **s)
    assert isinstance(hf, HuggingFaceSource)
    assert (hf.repo_id, hf.requested_revision, hf.token, hf.uri) == (REPO, "v1", "hf_x", f"hf://{REPO}")
    assert source_for(REPO, **s).requested_revision == "main"
    assert source_for(REPO, revision=SHA).requested_revision == SHA
    assert source_for(f"{REPO}@{SHA}", revision=SHA).requested_revision == SHA
    with pytest.raises(ProvisionError, match="GLMFLASH_MODEL_REVISION"):
        source_for(f"{REPO}@v1", revision=SHA)
    # An existing directory wins over an id-shaped name; path-shaped names never go to the hub.
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert isinstance(source_for("org/name", **s), LocalSource)
    with pytest.raises(ProvisionError, match="does not exist"):
        source_for("./org/other", **s)
    with pytest.raises(ProvisionError, match="does not exist"):
        source_for("/no/such/snapshot", **s)
    with pytest.raises(ProvisionError, match="neither an existing directory"):
        source_for("org/bad name", **s)
    with pytest.raises(ProvisionError, match="no model source"):
        source_for("  ", **s)


@pytest.mark.parametrize("path,keep", [
    ("config.json", True), ("generation_config.json", True), ("model.safetensors.index.json", True),
    ("model-00001-of-00047.safetensors", True), ("tokenizer.json", True), ("tokenizer_config.json", True),
    ("tokenizer.model", True), ("chat_template.jinja", True), ("merges.txt", True), ("vocab.txt", True),
    ("special_tokens_map.json", True), ("sub/config.json", True),
    ("README.md", False), ("readme.txt", False), (".gitattributes", False), ("figures/bench.png", False),
    ("original/model.safetensors", False), ("images/x.json", False), ("pytorch_model.bin", False),
    ("modeling_glm.py", False), ("glmflash-manifest.json", False), (".partial/config.json", False),
    ("LICENSE", False), ("model.gguf", False),
])
def test_is_snapshot_file(path, keep):
    assert is_snapshot_file(path) is keep


def test_files_from_siblings():
    from huggingface_hub.hf_api import ModelInfo

    info = ModelInfo(**_model_info_json({"config.json": b"{}", "README.md": b"#",
                                         "model.safetensors": b"\0" * 10, "original/x.safetensors": b"1"}))
    files = {f.path: f for f in files_from_siblings(info.siblings, f"hf://{REPO}")}
    assert set(files) == {"config.json", "model.safetensors"}
    lfs = files["model.safetensors"]
    assert (lfs.size, lfs.checksum, lfs.checksum_kind) == (10, hashlib.sha256(b"\0" * 10).hexdigest(), "sha256")
    blob = files["config.json"]
    assert blob.checksum_kind is None and blob.checksum == _blob_id(b"{}") and "revision marker" in blob.note


# -- a local stand-in for the hub's model_info and resolve routes ---------------------------------------
def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _model_info_json(files: dict[str, bytes]) -> dict:
    siblings = []
    for path, data in files.items():
        s = {"rfilename": path, "size": len(data), "blobId": _blob_id(data)}
        if path.endswith(".safetensors"):
            s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        siblings.append(s)
    return {"id": REPO, "modelId": REPO, "sha": SHA, "private": False, "siblings": siblings}


class FakeHub:
    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.requests: list[tuple[str, str | None]] = []
        self.ignore_range = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requests.append((self.path, self.headers.get("Range")))
                path = self.path.split("?")[0]
                if m := re.fullmatch(rf"/api/models/{REPO}/revision/([^/]+)", path):
                    if m.group(1) not in ("main", SHA):
                        return self._send(404, b'{"error": "Revision Not Found"}',
                                          {"X-Error-Code": "RevisionNotFound"})
                    return self._send(200, json.dumps(_model_info_json(hub.files)).encode(),
                                      {"Content-Type": "application/json"})
                if m := re.fullmatch(rf"/{REPO}/resolve/{SHA}/(.+)", path):
                    data = hub.files.get(m.group(1))
                    if data is None:
                        return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
                    rng = self.headers.get("Range")
                    if rng and not hub.ignore_range:
                        start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                        return self._send(206, data[start:],
                                          {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
                    return self._send(200, data)
                self._send(404, b"not found")

            def _send(self, status, body, headers=None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def ranges_for(self, name: str) -> list[str | None]:
        return [r for p, r in self.requests if p.endswith("/" + name)]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")          # never read a stored token
    files = snapshot_bytes(seed=2)
    h = FakeHub(files)
    yield h
    h.close()


def test_hf_download_pins_sha_and_verifies_lfs_sha256(hub, tmp_path):
    src = HuggingFaceSource(REPO, "main", endpoint=hub.endpoint)
    info = src.describe()
    assert (info.kind, info.uri, info.revision) == ("hf", f"hf://{REPO}", SHA)
    manifest = download_snapshot(src, tmp_path / "cache", workers=3)
    assert tree_bytes(tmp_path / "cache") == serving_only(hub.files)
    entries = {f.path: f for f in manifest.files}
    assert entries[BIG].verified == "sha256" and entries[BIG].checksum == hashlib.sha256(hub.files[BIG]).hexdigest()
    assert entries["config.json"].verified.startswith("size-only") and entries["config.json"].checksum_kind is None
    # every download went to the pinned commit, never to a branch name
    assert all(f"/resolve/{SHA}/" in p for p, _ in hub.requests if "/resolve/" in p)
    assert check_snapshot(tmp_path / "cache", info).state == "complete"


def test_hf_killed_download_resumes_with_range(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 256 << 10)
    dest = tmp_path / "cache"
    n = []

    def kill(ev):
        if ev.event == "bytes" and ev.path == BIG:
            n.append(ev)
            if len(n) == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download_snapshot(HuggingFaceSource(REPO, endpoint=hub.endpoint), dest, workers=1, on_progress=kill)
    have = (dest / ".partial" / BIG).stat().st_size
    assert 0 < have < len(hub.files[BIG]) and not (dest / BIG).exists()

    hub.requests.clear()
    download_snapshot(HuggingFaceSource(REPO, endpoint=hub.endpoint), dest, workers=1)
    assert hub.ranges_for(BIG) == [f"bytes={have}-"]
    assert tree_bytes(dest) == serving_only(hub.files)


def test_hf_resume_survives_a_server_ignoring_range(hub, tmp_path):
    dest = tmp_path / "cache"
    (dest / ".partial").mkdir(parents=True)
    src = HuggingFaceSource(REPO, endpoint=hub.endpoint)
    big = next(f for f in src.list_files() if f.path == BIG)
    (dest / ".partial" / BIG).write_bytes(hub.files[BIG][:1000])
    hub.ignore_range = True
    src.fetch(big, dest / ".partial" / BIG, lambda n: None)
    assert (dest / ".partial" / BIG).read_bytes() == hub.files[BIG]


def test_hf_wrong_bytes_rejected(hub, tmp_path):
    src = HuggingFaceSource(REPO, endpoint=hub.endpoint)
    src.list_files()                                   # listing (and sha256s) pinned before the bytes change
    hub.files[SMALL] = b"\1" * len(hub.files[SMALL])
    with pytest.raises(ProvisionError, match=f"{SMALL}: sha256 mismatch: expected [0-9a-f]{{64}}, found"):
        download_snapshot(src, tmp_path / "cache", workers=1)


def test_hf_unknown_revision_names_the_source(hub):
    with pytest.raises(ProvisionError, match=f"hf://{REPO}@nope.*RevisionNotFound"):
        HuggingFaceSource(REPO, "nope", endpoint=hub.endpoint).describe()


def test_hf_start_downloads_into_the_cache_and_reads_the_files_there(tmp_path, monkeypatch):
    """A cold start from the hub: the files land in the cache (verified), the weights are read from there,
    the prepared snapshot is written, and the next start is a fast_resume that asks the hub nothing."""
    import worker.provisioning
    from engine.tiny.factory import write_tiny_model
    from provision.stages import StageClock

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    src = write_tiny_model(tmp_path / "src", "fp8")
    hub = FakeHub({p.name: p.read_bytes() for p in src.iterdir()})
    monkeypatch.setattr(worker.provisioning, "source_for",
                        lambda spec, **_: HuggingFaceSource(spec, endpoint=hub.endpoint, token="hf_dummy"))
    settings = Settings(model=REPO, cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    try:
        clock = StageClock(300)
        loaded = worker.provisioning.provision_and_load(settings, clock)
        assert [n for n, _ in clock.history] == ["cold", "download", "verify", "prepare", "load"]
        assert loaded.files.parent == settings.cache_dir / "models" / loaded.files.parent.name
        assert tree_bytes(loaded.files) == {p.name: p.read_bytes() for p in src.iterdir()}
        loaded.prepare.write(workers=2)
        hub.requests.clear()
        clock = StageClock(300)
        worker.provisioning.provision_and_load(settings, clock)
        assert [n for n, _ in clock.history] == ["fast_resume", "load"] and hub.requests == []
    finally:
        hub.close()


@pytest.mark.skipif(os.environ.get("GLMFLASH_TEST_HUB") != "1",
                    reason="needs network access to huggingface.co (none on CI/this machine); "
                           "set GLMFLASH_TEST_HUB=1 and optionally GLMFLASH_TEST_HUB_REPO=org/name to run")
def test_real_hub_snapshot(tmp_path):
    repo = os.environ.get("GLMFLASH_TEST_HUB_REPO", "hf-internal-testing/tiny-random-LlamaForCausalLM")
    src = source_for(repo, token=os.environ.get("HF_TOKEN"))
    info = src.describe()
    assert re.fullmatch(r"[0-9a-f]{40}", info.revision)
    manifest = download_snapshot(src, tmp_path / "cache", workers=4)
    assert manifest.complete and any(f.path == "config.json" for f in manifest.files)
    assert check_snapshot(tmp_path / "cache", info).state == "complete"
