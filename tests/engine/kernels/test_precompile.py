"""Kernel-manifest entries compiled into Triton's cache by child processes, without a GPU (a compile targets
an architecture): a real kernel of ours for sm_90, a second pass that only reads the cache, entries from
another installation and the package's manifest merged with the recorded one."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

from tests.child_env import child_env
from tests.engine.kernels.kernel_entries import KEY, cache_files, rms_norm_entry
from engine.kernels import manifest_store
from engine.kernels.kernel_manifest import manifest_entries
from engine.kernels.manifest_store import packaged_manifest
from engine.kernels.precompile import localized, precompile

def test_children_compile_into_the_cache_and_a_second_pass_only_reads(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    entries = [rms_norm_entry(1024), rms_norm_entry(4096),
               {**rms_norm_entry(2048), "source": "an older source"},  # skipped: not this kernel's specialization
               {"module": "engine.kernels.norm.triton_norm", "name": "gone", "data": "{}", "source": "x"}]
    finished = list(precompile(entries, 90, processes=2))
    files = cache_files(cache)
    assert sorted(len(share) for share, _ in finished) == [2, 2] and sum(n for _, n in finished) == 2
    assert sum(name.endswith(".cubin") for name in files) == 2
    assert all("_rms_norm_kernel" in name for name in files if name.endswith(".cubin"))
    assert [n for _, n in precompile(entries[:2], 90, processes=1)] == [2]
    assert cache_files(cache) == files  # the same cache keys: read back, nothing compiled again


def test_library_paths_from_another_installation_fall_back_to_tritons_own():
    spec = json.loads(rms_norm_entry(1024)["data"])
    here = spec["options"]["extern_libs"]
    assert localized(json.dumps(spec))["options"]["extern_libs"] == here  # this installation's: kept
    spec["options"]["extern_libs"] = [["libdevice", "/elsewhere/triton/lib/libdevice.10.bc"]]
    assert localized(json.dumps(spec))["options"]["extern_libs"] is None
    options = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"num_warps": 4})
    assert [list(lib) for lib in options.extern_libs] == here  # Triton's default: the file the path named


def test_the_packaged_manifest_joins_the_recorded_one(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_store, "MANIFESTS", tmp_path / "manifests")
    packaged = packaged_manifest(KEY)
    assert packaged == tmp_path / "manifests" / "sm90-bfloat16.json"
    a, b, c = rms_norm_entry(1024), rms_norm_entry(2048), rms_norm_entry(4096)
    packaged.parent.mkdir()
    packaged.write_text(json.dumps({"key": KEY, "kernels": [a, b]}))
    recorded = tmp_path / "kernels.json"
    assert manifest_entries(recorded, KEY) == ([], [a, b])  # a first start on a fresh volume
    recorded.write_text(json.dumps({"key": KEY, "kernels": [b, c]}))
    assert manifest_entries(recorded, KEY) == ([b, c], [b, c, a])
    assert manifest_entries(recorded, {**KEY, "triton": "9.9"}) == ([], [])  # another Triton: neither


@pytest.mark.parametrize("capability", ["9.0", "10.0"])
def test_packaged_manifests_name_their_architecture(capability, tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_store, "MANIFESTS", tmp_path)
    assert packaged_manifest({**KEY, "capability": capability}).name == f"sm{capability.replace('.', '')}-bfloat16.json"


def test_shipping_merges_recorded_manifests_into_the_package(tmp_path, monkeypatch):
    from ops.ship_kernel_manifest import ship

    monkeypatch.setattr(manifest_store, "MANIFESTS", tmp_path / "manifests")
    a, b, c = rms_norm_entry(1024), rms_norm_entry(2048), rms_norm_entry(4096)
    for name, kernels in (("one.json", [a, b]), ("two.json", [b, c])):
        (tmp_path / name).write_text(json.dumps({"key": KEY, "kernels": kernels}))
    assert ship([tmp_path / "one.json", tmp_path / "two.json"]) == [packaged_manifest(KEY)] * 2
    shipped = json.loads(packaged_manifest(KEY).read_text())
    assert shipped["key"] == KEY
    assert sorted(e["data"] for e in shipped["kernels"]) == sorted(e["data"] for e in (a, b, c))


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_shares_keep_a_small_package_together_and_spread_the_largest(processes):
    from engine.kernels.precompile import split_by_package

    entries = [{"module": f"engine.kernels.k{i}", "data": str(i)} for i in range(9)]
    entries += [{"module": f"fla.ops.f{i}", "data": f"f{i}"} for i in range(3)]
    shares = split_by_package(entries, processes)
    assert sorted(e["data"] for share in shares for e in share) == sorted(e["data"] for e in entries)
    assert len(shares) == max(2, processes)  # fla's own share, then the rest
    fla_shares = [share for share in shares if any(e["module"].startswith("fla.") for e in share)]
    assert len(fla_shares) == 1 and all(e["module"].startswith("fla.") for e in fla_shares[0])
    assert split_by_package(entries[:9], processes) == [entries[i:9:processes] for i in range(processes)]


def test_resettle_rewrites_sources_as_this_installation_hashes_them(tmp_path):
    good = rms_norm_entry(1024)
    manifest = tmp_path / "sm90-bfloat16.json"
    manifest.write_text(json.dumps({"key": KEY, "kernels": [{**good, "source": "recorded unsettled"}, good]}))
    done = subprocess.run([sys.executable, "-m", "ops.ship_kernel_manifest", "--resettle", str(manifest)],
                          env=child_env("TRITON_INTERPRET"),  # compiled, not the tests' interpreter
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sources_changed=1" in done.stdout
    assert [e["source"] for e in json.loads(manifest.read_text())["kernels"]] == [good["source"]] * 2


def test_a_stuck_child_is_stopped_and_costs_only_its_share(monkeypatch, caplog):
    from engine.kernels import precompile as module

    monkeypatch.setattr(module, "CHILD", "import time; time.sleep(60)")
    monkeypatch.setattr(module, "CHILD_TIMEOUT_S", 2)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="glmflash.engine"):
        finished = list(precompile([rms_norm_entry(1024), rms_norm_entry(2048)], 90, processes=2))
    assert [n for _, n in finished] == [0, 0] and time.monotonic() - start < 20
    assert caplog.text.count("event=kernel_precompile_failed error=timeout") == 2


def test_shares_come_back_as_their_children_finish(monkeypatch, caplog):
    """The caller loads a share as soon as its child is done, while slower children still compile; a child
    reads its share on stdin (here one that sleeps as long as its share says, then counts it)."""
    from engine.kernels import precompile as module

    monkeypatch.setattr(module, "CHILD", "import json, sys, time; e = json.load(sys.stdin); "
                                         "time.sleep(float(e[0]['data'])); print(len(e))")
    slow = [{"module": "engine.kernels.a", "name": "k", "data": "3"}, {"module": "engine.kernels.b", "name": "k",
                                                                     "data": "3"}]
    fast = [{"module": "fla.ops.x", "name": "k", "data": "0"}]
    start = time.monotonic()
    with caplog.at_level("INFO", logger="glmflash.engine"):
        finished = precompile(slow + fast, 90, processes=2)
        first = next(finished)
        assert first == (fast, 1) and time.monotonic() - start < 2.5  # before the slow child is done
        assert list(finished) == [(slow, 2)]
    assert "event=kernel_precompile child=0 package=fla kernels=1 compiled=1" in caplog.text


def test_every_shipped_kernel_of_ours_compiles_for_its_architecture(tmp_path, monkeypatch):
    """CI runs our kernels in Triton's interpreter, which takes code the compiler rejects (a loop variable that
    changed type passed it and failed the first GPU start): each shipped specialization of ours compiles here,
    for the architecture its manifest names, without a GPU."""
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    manifests = sorted((manifest_store.MANIFESTS).glob("*.json"))
    assert manifests
    for manifest in manifests:
        shipped = json.loads(manifest.read_text())
        ours = [e for e in shipped["kernels"] if e["module"].startswith("engine.")]
        capability = int(shipped["key"]["capability"].replace(".", ""))
        assert sum(n for _, n in precompile(ours, capability, processes=2)) == len(ours), manifest.name
