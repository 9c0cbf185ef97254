"""Local-directory source through the real orchestrator: download, checks, repair, resume."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from provision.cache import (MANIFEST_NAME, check_snapshot, read_manifest, repair_snapshot, verify_hashes,
                             write_manifest)
from provision.download import download_snapshot
from provision.errors import ProvisionError
from provision.sources import LocalSource, RemoteFile, source_for
from provision_helpers import BIG, SKIPPED, SMALL, serving_only, snapshot_bytes, tree_bytes, write_tree


class SpySource(LocalSource):
    """A LocalSource that records each fetch and the size of the partial file it started from."""

    def __init__(self, root, **kw):
        super().__init__(root, **kw)
        self.fetched: list[tuple[str, int]] = []

    def fetch(self, file, dest, progress):
        self.fetched.append((file.path, dest.stat().st_size if dest.exists() else 0))
        super().fetch(file, dest, progress)


@pytest.fixture
def snap(tmp_path):
    files = snapshot_bytes()
    return write_tree(tmp_path / "src", files), files


def test_download_writes_serving_files_and_manifest(snap, tmp_path):
    src_dir, files = snap
    source = source_for(str(src_dir))
    assert isinstance(source, LocalSource)
    events = []
    manifest = download_snapshot(source, tmp_path / "cache", workers=3, on_progress=events.append)

    dest = tmp_path / "cache"
    assert tree_bytes(dest) == serving_only(files)                  # README, images/, original/ skipped
    assert not (dest / ".partial").exists()
    assert manifest.complete and manifest.source == source.describe()
    on_disk = json.loads((dest / MANIFEST_NAME).read_text())
    assert on_disk["complete"] is True and on_disk["format_version"] == 1
    assert on_disk["source"] == {"kind": "local", "uri": str(src_dir.resolve()),
                                 "revision": source.describe().revision}
    by_path = {f["path"]: f for f in on_disk["files"]}
    assert set(by_path) == set(serving_only(files))
    for path, data in serving_only(files).items():
        assert by_path[path]["size"] == len(data)
        assert by_path[path]["sha256"] == hashlib.sha256(data).hexdigest()
        assert by_path[path]["verified"].startswith("size-only")     # a directory publishes no checksums
    assert events[-1].event == "done" and events[-1].done_files == len(by_path)
    assert events[-1].done_bytes == events[-1].total_bytes == sum(map(len, serving_only(files).values()))

    status = check_snapshot(dest, source.describe())
    assert status.state == "complete" and status.problems == []
    assert verify_hashes(dest, workers=4) == []


def test_rerun_fetches_nothing(snap, tmp_path):
    src_dir, _ = snap
    download_snapshot(LocalSource(src_dir), tmp_path / "cache")
    spy = SpySource(src_dir)
    download_snapshot(spy, tmp_path / "cache")
    assert spy.fetched == []


def test_truncated_file_is_corrupt_and_refetched_alone(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    with open(dest / BIG, "r+b") as f:
        f.truncate(1000)

    status = check_snapshot(dest)
    assert status.state == "corrupt"
    assert status.bad_files == [BIG]
    assert any(BIG in p and str(len(files[BIG])) in p and "found 1000 bytes" in p for p in status.problems)

    spy = SpySource(src_dir)
    download_snapshot(spy, dest)
    assert spy.fetched == [(BIG, 0)]
    assert (dest / BIG).read_bytes() == files[BIG]
    assert check_snapshot(dest).state == "complete"


def test_flipped_byte_found_by_hash_repaired_and_refetched_alone(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    with open(dest / BIG, "r+b") as f:
        f.seek(len(files[BIG]) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    assert (src_dir / BIG).read_bytes() == files[BIG]             # the cache shares no inode with the source

    assert check_snapshot(dest).state == "complete"                # same size: the cheap check cannot see it
    problems = verify_hashes(dest, workers=2)
    assert [p.path for p in problems] == [BIG]
    good = hashlib.sha256(files[BIG]).hexdigest()
    assert "sha256 mismatch" in str(problems[0]) and good in str(problems[0]) and BIG in str(problems[0])

    assert repair_snapshot(dest, problems) == [BIG]
    assert not (dest / BIG).exists()
    assert check_snapshot(dest).state == "partial"

    spy = SpySource(src_dir)
    download_snapshot(spy, dest)
    assert spy.fetched == [(BIG, 0)]
    assert tree_bytes(dest) == serving_only(files)
    assert verify_hashes(dest) == []


def test_repair_without_list_rehashes(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    (dest / "config.json").write_bytes(b"{}" + b" " * (len(files["config.json"]) - 2))
    assert repair_snapshot(dest) == ["config.json"]
    assert check_snapshot(dest).state == "partial"


def test_verify_existing_refetches_silently_corrupted_file(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    with open(dest / SMALL, "r+b") as f:
        f.write(b"\0\0\0\0")
    spy = SpySource(src_dir)
    download_snapshot(spy, dest, verify_existing=True)
    assert spy.fetched == [(SMALL, 0)]
    assert (dest / SMALL).read_bytes() == files[SMALL]


def test_killed_download_resumes_from_partial_prefix(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    chunk = 256 << 10

    class Killed(Exception):
        pass

    seen = []

    def kill_after_two_big_chunks(ev):
        if ev.event == "bytes" and ev.path == BIG:
            seen.append(ev)
            if len(seen) == 2:
                raise Killed()

    with pytest.raises(Killed):
        download_snapshot(LocalSource(src_dir, chunk_size=chunk, reflink=False), dest, workers=1,
                          on_progress=kill_after_two_big_chunks)
    # Never visible at its final path; the prefix waits under .partial/.
    assert not (dest / BIG).exists()
    partial = dest / ".partial" / BIG
    assert partial.stat().st_size == 2 * chunk
    status = check_snapshot(dest)
    assert status.state == "partial"
    assert BIG not in {f.path for f in status.manifest.files}

    spy = SpySource(src_dir, chunk_size=chunk, reflink=False)
    copied = []
    download_snapshot(spy, dest, workers=1,
                      on_progress=lambda ev: copied.append(ev) if ev.path == BIG and ev.event == "bytes" else None)
    assert (BIG, 2 * chunk) in spy.fetched                          # resumed from the prefix
    assert copied[-1].done_bytes - copied[0].done_bytes + chunk == len(files[BIG]) - 2 * chunk
    assert tree_bytes(dest) == serving_only(files)
    assert check_snapshot(dest, spy.describe()).state == "complete"
    assert not (dest / ".partial").exists()


def test_partial_of_another_version_is_not_resumed(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    chunk = 256 << 10

    def kill(ev):
        if ev.event == "bytes" and ev.path == BIG:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download_snapshot(LocalSource(src_dir, chunk_size=chunk, reflink=False), dest, workers=1, on_progress=kill)
    assert (dest / ".partial" / BIG).stat().st_size == chunk

    new = bytearray(files[BIG])
    new[:10] = b"0123456789"                                         # same size, new content, new mtime
    (src_dir / BIG).write_bytes(bytes(new))
    os.utime(src_dir / BIG, ns=(1, 1))
    spy = SpySource(src_dir)
    download_snapshot(spy, dest)
    assert (BIG, 0) in spy.fetched                                   # the old prefix was discarded
    assert (dest / BIG).read_bytes() == bytes(new)


def test_stale_when_source_changed(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    (src_dir / "config.json").write_bytes(b'{"model_type": "glm5_next", "hidden_size": 128}\n')
    changed = LocalSource(src_dir)
    status = check_snapshot(dest, changed.describe())
    assert status.state == "stale" and str(changed.describe().revision) in status.problems[0]
    download_snapshot(changed, dest)
    assert (dest / "config.json").read_bytes().endswith(b"128}\n")
    assert check_snapshot(dest, changed.describe()).state == "complete"


def test_file_dropped_by_new_revision_is_removed(snap, tmp_path):
    src_dir, _ = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    (src_dir / "generation_config.json").unlink()
    download_snapshot(LocalSource(src_dir), dest)
    assert not (dest / "generation_config.json").exists()


class LyingSource(LocalSource):
    """Publishes a wrong sha256 for one file: verification must refuse it."""

    def list_files(self):
        return [RemoteFile(f.path, f.size, "0" * 64, "sha256") if f.path == SMALL else f
                for f in super().list_files()]


def test_checksum_mismatch_names_file_expected_and_found(snap, tmp_path):
    src_dir, files = snap
    dest = tmp_path / "cache"
    with pytest.raises(ProvisionError) as err:
        download_snapshot(LyingSource(src_dir), dest, workers=1)
    msg = str(err.value)
    assert SMALL in msg and "0" * 64 in msg and hashlib.sha256(files[SMALL]).hexdigest() in msg
    assert err.value.path == SMALL
    assert not (dest / SMALL).exists() and not (dest / ".partial" / SMALL).exists()
    assert SMALL not in {f.path for f in read_manifest(dest).files}


def test_unmanifested_final_file_is_not_trusted(snap, tmp_path):
    """A file at a final path with no manifest entry (and no checksum to prove it) is refetched."""
    src_dir, files = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    manifest = read_manifest(dest)
    manifest.files = [f for f in manifest.files if f.path != SMALL]
    manifest.complete = False
    write_manifest(dest, manifest)
    (dest / SMALL).write_bytes(b"\0" * len(files[SMALL]))
    spy = SpySource(src_dir)
    download_snapshot(spy, dest)
    assert spy.fetched == [(SMALL, 0)]
    assert (dest / SMALL).read_bytes() == files[SMALL]


def test_unreadable_manifest_is_corrupt(snap, tmp_path):
    src_dir, _ = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    (dest / MANIFEST_NAME).write_text("{not json")
    status = check_snapshot(dest)
    assert status.state == "corrupt" and MANIFEST_NAME in status.problems[0]
    assert check_snapshot(tmp_path / "nowhere").state == "missing"


def test_manifest_paths_cannot_escape(snap, tmp_path):
    src_dir, _ = snap
    dest = tmp_path / "cache"
    download_snapshot(LocalSource(src_dir), dest)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    data["files"][0]["path"] = "../outside.json"
    (dest / MANIFEST_NAME).write_text(json.dumps(data))
    status = check_snapshot(dest)
    assert status.state == "corrupt" and "../outside.json" in status.problems[0]


def test_skipped_names_never_listed(snap):
    src_dir, _ = snap
    listed = {f.path for f in LocalSource(src_dir).list_files()}
    assert not listed & set(SKIPPED)


def test_missing_local_dir_is_an_error(tmp_path):
    with pytest.raises(ProvisionError, match="does not exist"):
        source_for(str(tmp_path / "absent"))
    with pytest.raises(ProvisionError, match="does not exist"):
        LocalSource(Path(tmp_path / "absent"))


def test_concurrent_downloads_into_one_dir_do_not_fetch_twice(snap, tmp_path):
    import threading

    src_dir, files = snap
    dest = tmp_path / "cache"
    first, second = SpySource(src_dir), SpySource(src_dir)
    started = threading.Event()

    def slow(ev):
        started.set()
        threading.Event().wait(0.02)

    t = threading.Thread(target=download_snapshot, args=(first, dest), kwargs={"on_progress": slow})
    t.start()
    assert started.wait(10)
    download_snapshot(second, dest)          # waits for the lock, then finds everything in place
    t.join()
    assert second.fetched == [] and len(first.fetched) == len(serving_only(files))
    assert tree_bytes(dest) == serving_only(files)
