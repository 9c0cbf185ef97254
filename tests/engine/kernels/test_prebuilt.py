"""Kernels compiled when an image is built (no GPU: a compile targets an architecture), copied into a volume's
Triton cache at start and counted there as compiled: a real kernel of ours for sm_90, through the module's
command line as a Dockerfile runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.child_env import child_env
from tests.engine.kernels.kernel_entries import KEY, cache_files, rms_norm_entry
from engine.kernels.kernel_manifest import manifest_entries
from engine.kernels.prebuilt import MANIFEST, TRITON, seed, seeded_manifest
from worker.compile_cache import seed_prebuilt_kernels


def prebuild(directory, *manifests) -> str:
    args = [arg for m in manifests for arg in ("--manifest", str(m))]
    done = subprocess.run([sys.executable, "-m", "engine.kernels.prebuilt", str(directory), *args, "--processes", "2"],
                          env=child_env("TRITON_INTERPRET", "TRITON_CACHE_DIR"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_an_image_build_compiles_what_hashes_here_and_a_start_counts_it_as_cached(tmp_path, monkeypatch):
    a, b = rms_norm_entry(1024), rms_norm_entry(4096)
    stale = {**rms_norm_entry(2048), "source": "hashed otherwise on the build machine"}
    manifest = tmp_path / "sm90-bfloat16.json"
    manifest.write_text(json.dumps({"key": KEY, "kernels": [a, stale, b]}))
    other = tmp_path / "other-triton.json"
    other.write_text(json.dumps({"key": {**KEY, "triton": "0.0.1"}, "kernels": [rms_norm_entry(512)]}))
    prebuilt = tmp_path / "prebuilt"
    assert "compiled=2 left_out=2" in prebuild(prebuilt, manifest, other)
    built = cache_files(prebuilt / TRITON)
    assert sum(name.endswith(".cubin") for name in built) == 2
    assert [m["key"] for m in json.loads((prebuilt / MANIFEST).read_text())] == [KEY]

    volume = tmp_path / "volume" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(volume))
    recorded = tmp_path / "volume" / "kernels.json"
    assert manifest_entries(recorded, KEY)[0] == []  # nothing in this cache yet
    assert seed_prebuilt_kernels(prebuilt, volume) == len({name.split("/")[0] for name in built})
    assert cache_files(volume) - {MANIFEST} == built
    assert [e["data"] for e in seeded_manifest(volume, KEY)] == [a["data"], b["data"]]
    assert seeded_manifest(volume, {**KEY, "dtype": "float32"}) == []
    recorded.write_text(json.dumps({"key": KEY, "kernels": [b]}))  # an earlier start on this volume
    cached, entries = manifest_entries(recorded, KEY)
    assert [e["data"] for e in cached] == [b["data"], a["data"]]  # no child compiles either


def test_seeding_again_copies_nothing_and_merges_manifests(tmp_path):
    volume = tmp_path / "triton"
    assert seed(tmp_path / "no image", volume) == 0 and not volume.exists()  # outside the image: nothing
    first, second = tmp_path / "first", tmp_path / "second"
    for directory, entries in ((first, [{"data": "x"}]), (second, [{"data": "x"}, {"data": "y"}])):
        (directory / TRITON / f"key-{directory.name}").mkdir(parents=True)
        (directory / TRITON / f"key-{directory.name}" / "k.cubin").write_bytes(b"binary")
        (directory / MANIFEST).write_text(json.dumps([{"key": KEY, "kernels": entries}]))
    assert seed(first, volume) == 1
    assert seed(first, volume) == 0  # present: kept as it is
    (volume / "key-second").mkdir()  # another start seeded it meanwhile
    assert seed(second, volume) == 0
    assert [e["data"] for e in seeded_manifest(volume, KEY)] == ["x", "y"]
    assert not [p for p in volume.iterdir() if p.name.endswith(".part")]


def test_an_unwritable_volume_is_a_warning_and_the_start_goes_on(tmp_path, caplog):
    prebuilt = tmp_path / "prebuilt"
    (prebuilt / TRITON / "key").mkdir(parents=True)
    (prebuilt / MANIFEST).write_text("[]")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    assert seed_prebuilt_kernels(prebuilt, blocked / "triton") == 0
    assert "event=prebuilt_kernels_unseeded" in caplog.text
    assert seed_prebuilt_kernels(None, tmp_path / "triton") == 0
