"""S3 source against a real S3 API (moto's server on localhost): ranged parts, ETags, resume."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from provision.cache import check_snapshot, read_manifest
from provision.download import download_snapshot
from provision.errors import ProvisionError
from provision.sources import S3Source, source_for
from provision_helpers import BIG, SMALL, GetLog, serving_only, snapshot_bytes, tree_bytes, upload

MiB = 1 << 20
BIG_SIZE = 12 * MiB + 4321                   # 13 download parts of 1 MiB; uploaded as 5+5+2.x MiB
UPLOAD_PARTS = {BIG: [5 * MiB, 5 * MiB, 0]}  # last part takes the rest -> ETag "<md5>-3"


@pytest.fixture
def snapshot(s3, bucket):
    files = snapshot_bytes(seed=1, big_size=BIG_SIZE)
    upload(s3, bucket, "glm/flash", files, multipart=UPLOAD_PARTS)
    return f"s3://{bucket}/glm/flash", files


def make_source(uri, endpoint, workers=4, part_size=MiB):
    return S3Source(uri, endpoint_url=endpoint, workers=workers, part_size=part_size)


def test_source_for_s3_uses_settings(moto_endpoint, aws_env):
    src = source_for("s3://bucket/some/prefix/", endpoint_url=moto_endpoint, workers=3)
    assert isinstance(src, S3Source)
    assert (src.bucket, src.prefix, src.uri, src.endpoint_url, src.workers) == (
        "bucket", "some/prefix", "s3://bucket/some/prefix", moto_endpoint, 3)


def test_listing_classifies_etags(snapshot, moto_endpoint, s3):
    uri, files = snapshot
    src = make_source(uri, moto_endpoint)
    listed = {f.path: f for f in src.list_files()}
    assert set(listed) == set(serving_only(files))
    big = listed[BIG]
    assert big.checksum_kind == "etag" and big.checksum.endswith("-3") and big.etag_part_size == 5 * MiB
    assert listed[SMALL].checksum_kind == "md5" and "-" not in listed[SMALL].checksum
    info = src.describe()
    assert info.kind == "s3" and info.uri == uri and info.revision.startswith("s3-")
    assert make_source(uri, moto_endpoint).describe() == info        # deterministic digest of the listing
    s3.put_object(Bucket=src.bucket, Key="glm/flash/config.json", Body=b"{}")
    assert make_source(uri, moto_endpoint).describe().revision != info.revision


def test_download_verifies_md5_and_multipart_etag(snapshot, moto_endpoint, tmp_path):
    uri, files = snapshot
    src = make_source(uri, moto_endpoint)
    gets = GetLog(src.client)
    manifest = download_snapshot(src, tmp_path / "cache", workers=3)

    assert tree_bytes(tmp_path / "cache") == serving_only(files)
    entries = {f.path: f for f in manifest.files}
    assert entries[BIG].verified == f"etag-multipart/{5 * MiB}"
    assert entries[SMALL].verified == "md5" and entries["config.json"].verified == "md5"
    assert len(gets.for_key(BIG)) == math.ceil(BIG_SIZE / MiB)       # parallel ranged parts
    assert sorted(gets.for_key(BIG), key=lambda r: int(r.split("=")[1].split("-")[0]))[-1] == \
        f"bytes={12 * MiB}-{BIG_SIZE - 1}"
    assert check_snapshot(tmp_path / "cache", src.describe()).state == "complete"
    assert read_manifest(tmp_path / "cache").complete


def test_killed_download_resumes_without_refetching_parts(snapshot, moto_endpoint, tmp_path):
    uri, files = snapshot
    dest = tmp_path / "cache"

    class Killed(Exception):
        pass

    big_events = []

    def kill_after_four_parts(ev):
        if ev.event == "bytes" and ev.path == BIG:
            big_events.append(ev)
            if len(big_events) == 4:
                raise Killed("simulated kill")

    first = make_source(uri, moto_endpoint, workers=2)
    with pytest.raises(Killed):
        download_snapshot(first, dest, workers=2, on_progress=kill_after_four_parts)
    first.close()

    assert not (dest / BIG).exists()                                   # never visible half-written
    parts_file = dest / ".partial" / (BIG + ".glmflash-parts")
    done = {int(x) for x in parts_file.read_text().split("\n")[1:] if x}
    assert len(done) >= 4
    landed = {f.path for f in read_manifest(dest).files}

    second = make_source(uri, moto_endpoint, workers=2)
    gets = GetLog(second.client)
    download_snapshot(second, dest, workers=2)

    refetched = {int(r.split("=")[1].split("-")[0]) // MiB for r in gets.for_key(BIG)}
    assert refetched == set(range(math.ceil(BIG_SIZE / MiB))) - done      # only the missing parts
    assert not any(gets.for_key(p) for p in landed)                        # finished files not refetched
    assert tree_bytes(dest) == serving_only(files)                         # byte-identical
    assert check_snapshot(dest, second.describe()).state == "complete"


def test_sigkilled_download_resumes(snapshot, moto_endpoint, tmp_path):
    """A real kill -9 of a downloading process: the sidecar survives and the next run resumes."""
    uri, files = snapshot
    dest = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import time
        from provision.download import download_snapshot
        from provision.sources import S3Source
        src = S3Source({uri!r}, endpoint_url={moto_endpoint!r}, workers=1, part_size={MiB})
        def slow(ev):
            if ev.event == "bytes":
                time.sleep(0.15)
        download_snapshot(src, {str(dest)!r}, workers=1, on_progress=slow)
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=root)
    parts_file = dest / ".partial" / (BIG + ".glmflash-parts")
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if parts_file.exists() and len(parts_file.read_text().split("\n")) >= 1 + 1 + 3:
                break
            assert proc.poll() is None, "downloader exited before it could be killed"
            time.sleep(0.02)
        else:
            pytest.fail("the downloader never recorded 3 parts")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = {int(x) for x in parts_file.read_text().split("\n")[1:] if x}
    assert 3 <= len(done) < math.ceil(BIG_SIZE / MiB)
    assert not (dest / BIG).exists()

    src = make_source(uri, moto_endpoint)
    gets = GetLog(src.client)
    download_snapshot(src, dest)
    refetched = {int(r.split("=")[1].split("-")[0]) // MiB for r in gets.for_key(BIG)}
    assert refetched == set(range(math.ceil(BIG_SIZE / MiB))) - done
    assert tree_bytes(dest) == serving_only(files)


def _corrupt_in_store(bucket: str, key: str) -> None:
    """Flip one byte of an object inside moto's store, leaving its ETag as it was (bit rot)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key)
    etag = obj.etag
    data = bytearray(obj.value)
    data[len(data) // 3] ^= 0x01
    obj.value = bytes(data)
    assert obj.etag == etag and obj.size == len(data)


@pytest.mark.parametrize("name,kind", [(SMALL, "md5"), (BIG, "etag")])
def test_corrupted_object_is_rejected(snapshot, moto_endpoint, tmp_path, name, kind):
    uri, files = snapshot
    src = make_source(uri, moto_endpoint)
    expected = {f.path: f for f in src.list_files()}[name].checksum
    _corrupt_in_store(src.bucket, f"glm/flash/{name}")
    with pytest.raises(ProvisionError) as err:
        download_snapshot(src, tmp_path / "cache", workers=2)
    msg = str(err.value)
    assert name in msg and f"{kind} mismatch" in msg and expected in msg and "found " in msg
    assert err.value.path == name
    assert not (tmp_path / "cache" / name).exists()
    assert name not in {f.path for f in read_manifest(tmp_path / "cache").files}


def test_object_replaced_mid_download_is_refused(snapshot, moto_endpoint, s3, tmp_path):
    uri, files = snapshot
    src = make_source(uri, moto_endpoint)
    src.list_files()                                       # pinned: listing (and ETags) taken now
    s3.put_object(Bucket=src.bucket, Key=f"glm/flash/{SMALL}", Body=b"y" * len(files[SMALL]))
    with pytest.raises(ProvisionError, match=f"{SMALL}.*changed while downloading"):
        download_snapshot(src, tmp_path / "cache", workers=1)


def test_unreconstructable_multipart_etag_is_size_only_in_manifest(s3, bucket, moto_endpoint, tmp_path):
    data = os.urandom(12 * MiB)
    upload(s3, bucket, "snap", {"config.json": b"{}", BIG: data}, multipart={BIG: [6 * MiB, 5 * MiB, 0]})
    src = make_source(f"s3://{bucket}/snap", moto_endpoint)
    manifest = download_snapshot(src, tmp_path / "cache")
    entry = {f.path: f for f in manifest.files}[BIG]
    assert entry.checksum.endswith("-3") and entry.checksum_kind is None
    assert entry.verified.startswith("size-only: multipart ETag (3 parts)")
    assert (tmp_path / "cache" / BIG).read_bytes() == data


def test_missing_bucket_names_the_source(moto_endpoint, aws_env, tmp_path):
    src = make_source("s3://no-such-bucket-here/x", moto_endpoint)
    with pytest.raises(ProvisionError, match="s3://no-such-bucket-here/x.*NoSuchBucket"):
        download_snapshot(src, tmp_path / "cache")


def test_empty_prefix_is_an_error(s3, bucket, moto_endpoint, tmp_path):
    with pytest.raises(ProvisionError, match=f"s3://{bucket}/empty.*no snapshot files"):
        download_snapshot(make_source(f"s3://{bucket}/empty", moto_endpoint), tmp_path / "cache")


def test_zero_byte_object(s3, bucket, moto_endpoint, tmp_path):
    upload(s3, bucket, "z", {"config.json": b"{}", "tokenizer.txt": b""})
    manifest = download_snapshot(make_source(f"s3://{bucket}/z", moto_endpoint), tmp_path / "cache")
    assert (tmp_path / "cache" / "tokenizer.txt").read_bytes() == b""
    assert manifest.complete


def test_resumed_file_failing_verification_is_fetched_again_from_scratch(snapshot, moto_endpoint, tmp_path):
    """Bytes damaged in a finished part of a partial file (e.g. lost on a crash): one clean retry."""
    uri, files = snapshot
    dest = tmp_path / "cache"

    def kill(ev):
        if ev.event == "bytes" and ev.path == BIG:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download_snapshot(make_source(uri, moto_endpoint, workers=1), dest, workers=1, on_progress=kill)
    parts_file = dest / ".partial" / (BIG + ".glmflash-parts")
    done = sorted(int(x) for x in parts_file.read_text().split("\n")[1:] if x)
    with open(dest / ".partial" / BIG, "r+b") as f:         # damage a part the sidecar says is done
        f.seek(done[0] * MiB + 10)
        f.write(b"\xff\xfe")

    src = make_source(uri, moto_endpoint)
    gets = GetLog(src.client)
    download_snapshot(src, dest)
    n_parts = math.ceil(BIG_SIZE / MiB)
    assert len(gets.for_key(BIG)) == (n_parts - len(done)) + n_parts
    assert (dest / BIG).read_bytes() == files[BIG]
