"""The compiled-kernel manifest: Triton's compile hooks feed it (timed, chained to hooks set before), it is
kept atomically under a key of GPU, Triton and dtype, and a later start preloads what it lists, skipping
kernels whose source changed. The compiles themselves need a GPU (tests/gpu/test_kernel_manifest_cuda.py);
here Triton's side is played by objects of the same shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
from triton import knobs

from engine.kernels import kernel_manifest, manifest_store
from engine.kernels.kernel_manifest import CompileLog, preload, record_compiles
from engine.kernels.manifest_store import read_manifest, read_warm_up

KEY = {"capability": "9.0", "triton": "3.6.0", "dtype": "bfloat16", "shapes": "hidden=4096,experts=288"}


def compile_kwargs(module: str, name: str, data: str, source: str = "src") -> dict:
    """What Triton passes both hooks (jit.py's _call_hook), reduced to what the log reads."""
    fn = SimpleNamespace(module=module, name=name, jit_function=SimpleNamespace(cache_key=source))
    return {"key": (data, "options"), "fn": fn, "compile": {"specialization_data": data}, "repr": name}


def test_a_compile_is_timed_and_its_specialization_kept(tmp_path):
    compiles = CompileLog(key=KEY, file=tmp_path / "kernels.json")
    for data in ("a", "b", "a"):  # "a" twice: a second device or a cache reload, one entry
        compiles.before(**compile_kwargs("engine.kernels.norm", "_rms", data))
        compiles.after(**compile_kwargs("engine.kernels.norm", "_rms", data))
    assert compiles.count == 3 and compiles.seconds >= 0
    assert list(compiles.by_kernel) == ["engine.kernels.norm._rms"]
    assert not (tmp_path / "kernels.json").exists()  # not while the start reads weights
    summary = compiles.started()
    assert "count=3" in summary and "slowest=_rms:" in summary
    kept = read_manifest(tmp_path / "kernels.json", KEY)
    assert [(e["module"], e["name"], e["data"], e["source"]) for e in kept] == [
        ("engine.kernels.norm", "_rms", "a", "src"), ("engine.kernels.norm", "_rms", "b", "src")]
    assert not list(tmp_path.glob(".*.part"))  # written through a temporary file, renamed into place


def test_a_manifest_for_another_architecture_triton_dtype_or_model_or_torn_is_not_read(tmp_path):
    file = tmp_path / "kernels.json"
    compiles = CompileLog(key=KEY, file=file)
    compiles.after(**compile_kwargs("m", "k", "a"))
    compiles.started()
    assert len(read_manifest(file, KEY)) == 1
    for change in ({"capability": "10.0"}, {"triton": "3.7.0"}, {"dtype": "float32"}, {"shapes": "hidden=64"}):
        assert read_manifest(file, {**KEY, **change}) == []
    file.write_text(file.read_text()[:20])
    assert read_manifest(file, KEY) == []
    assert read_manifest(tmp_path / "absent.json", KEY) == []


def test_the_prefill_warm_up_is_kept_with_the_manifest_and_covers_a_later_start_that_preloaded_everything(tmp_path):
    """A start's prefill warm-up is written with its manifest; a later start skips it only where its preload read
    every kernel and what decides a prefill's kernels (longest step, offload, latent cache, drafts) is the same."""
    file = tmp_path / "kernels.json"
    signature = {"longest": 4096, "hybrid": True, "kv_cache_dtype": "auto", "drafts": 0}
    first = CompileLog(key=KEY, file=file)
    first.after(**compile_kwargs("m", "k", "a"))
    first.warmed = {"signature": signature, "lengths": [4096, 3424, 29, 3]}
    first.started()
    assert read_warm_up(file, KEY) == {"signature": signature, "lengths": [4096, 3424, 29, 3]}
    assert read_warm_up(file, {**KEY, "dtype": "float32"}) is None and read_warm_up(tmp_path / "absent", KEY) is None
    later = CompileLog(key=KEY, file=file, earlier_warm_up=read_warm_up(file, KEY))
    assert later.covered_prefills(signature) is None  # the preload has not read every kernel
    later.preloaded_all = True
    assert later.covered_prefills(signature) == [4096, 3424, 29, 3]
    for change in ({"longest": 8192}, {"hybrid": False}, {"kv_cache_dtype": "fp8"}, {"drafts": 2}):
        assert later.covered_prefills({**signature, **change}) is None  # other kernels, other builds
    assert CompileLog(key=KEY, file=file, preloaded_all=True).covered_prefills(signature) is None  # none recorded


def test_an_unwritable_manifest_is_a_warning_and_compiles_go_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    compiles = CompileLog(key=KEY, file=blocker / "kernels.json")  # its folder is a file
    with caplog.at_level("WARNING", logger="glmflash.engine"):
        compiles.after(**compile_kwargs("m", "k", "a"))
        compiles.started()
        compiles.after(**compile_kwargs("m", "k", "b"))
    assert compiles.count == 2 and compiles.file is None
    assert caplog.text.count("event=kernel_manifest_unwritable") == 1


def test_compiles_after_the_start_are_logged_one_by_one_and_kept_at_once(caplog, tmp_path):
    compiles = CompileLog(key=KEY, file=tmp_path / "kernels.json")
    with caplog.at_level("INFO", logger="glmflash.engine"):
        compiles.after(**compile_kwargs("m", "during_start", "a"))
        compiles.started()
        compiles.after(**compile_kwargs("m", "late", "b"))
    assert "kernel=m.late" in caplog.text and "during_start" not in caplog.text
    assert [e["data"] for e in read_manifest(tmp_path / "kernels.json", KEY)] == ["a", "b"]


def test_the_hooks_are_installed_once_and_chain_hooks_set_before(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("pre", kw["fn"].name)) or True)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["fn"].name)))
    monkeypatch.setattr(kernel_manifest, "COMPILES", CompileLog())
    monkeypatch.setattr(kernel_manifest, "_installed", False)
    compiles = record_compiles(tmp_path / "kernels.json", KEY)
    record_compiles(tmp_path / "kernels.json", KEY)  # a second engine: no second layer of hooks
    kwargs = compile_kwargs("m", "k", "a")
    assert knobs.runtime.jit_cache_hook(**kwargs) is True  # the earlier hook's answer (skip) still counts
    knobs.runtime.jit_post_compile_hook(**kwargs)
    assert seen == [("pre", "k"), ("post", "k")] and compiles.count == 1
    compiles.started()
    assert read_manifest(tmp_path / "kernels.json", KEY)[0]["data"] == "a"


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    """A module of objects shaped like Triton's: a JIT function, one inside an autotuner, one in a class."""
    (tmp_path / "fake_triton_kernels.py").write_text(textwrap.dedent("""
        import json

        class Jit:
            def __init__(self, source):
                self.cache_key, self.loaded = source, []

            def preload(self, data):
                self.loaded.append(json.loads(data)["id"])

        class Autotuner:
            def __init__(self, fn):
                self.fn = fn

        plain = Jit("src-plain")
        tuned = Autotuner(Autotuner(Jit("src-tuned")))

        class Holder:
            inner = Jit("src-inner")

        not_a_kernel = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("fake_triton_kernels")
    sys.modules.pop("fake_triton_kernels", None)


@pytest.mark.parametrize("workers", [1, 3])
def test_preload_compiles_what_the_manifest_lists(fake_kernels, caplog, workers):
    def entry(name: str, data: str, source: str) -> dict:
        return {"module": "fake_triton_kernels", "name": name, "data": json.dumps({"id": data, "options": {}}),
                "source": source}

    entries = [entry("plain", "p1", "src-plain"), entry("plain", "p2", "src-plain"), entry("tuned", "t1", "src-tuned"),
               entry("Holder.inner", "i1", "src-inner"),
               entry("plain", "stale", "src-before"),  # the kernel's source changed since: not its specialization
               entry("gone", "g1", "src"), entry("not_a_kernel", "n1", "src")]
    with caplog.at_level("WARNING", logger="glmflash.engine"):
        prepared = []  # the threads the initializer ran on (it sets each one's CUDA device)
        done, seconds = preload(entries, workers, initializer=lambda: prepared.append(threading.get_ident()))
    assert done == 4 and seconds >= 0 and 1 <= len(set(prepared)) <= workers
    assert sorted(fake_kernels.plain.loaded) == ["p1", "p2"]
    assert fake_kernels.tuned.fn.fn.loaded == ["t1"] and fake_kernels.Holder.inner.loaded == ["i1"]
    assert caplog.text.count("event=kernel_preload_failed") == 2
    assert "fake_triton_kernels.gone" in caplog.text and "not a Triton JIT function" in caplog.text


def test_without_a_file_compiles_are_counted_and_nothing_is_preloaded(monkeypatch):
    import torch

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(kernel_manifest, "COMPILES", CompileLog())
    monkeypatch.setattr(kernel_manifest, "_installed", False)
    assert kernel_manifest.start_preload(None, torch.device("cuda"), torch.bfloat16).result() == (0, 0.0)
    knobs.runtime.jit_post_compile_hook(**compile_kwargs("m", "k", "a"))
    assert kernel_manifest.COMPILES.count == 1 and kernel_manifest.COMPILES.file is None



def test_model_shapes_leave_out_the_layer_count():
    from engine.config import ModelConfig
    from engine.kernels.kernel_manifest import model_shapes
    from engine.tiny.factory import tiny_config
    from ops.bench_engine import slice_text_config

    release = model_shapes(ModelConfig.from_dict(slice_text_config(4)))
    assert release == model_shapes(ModelConfig.from_dict(slice_text_config(45)))  # a slice compiles what all do
    assert release == "hidden=4096,experts=288,moe=2048,kda=64x128,vocab=154880"
    assert model_shapes(ModelConfig.from_dict(tiny_config())) != release  # the shipped manifest is not the tiny's
    for shipped in manifest_store.MANIFESTS.glob("*.json"):  # what the package ships is for the release
        assert json.loads(shipped.read_text())["key"]["shapes"] == release


def test_the_shipped_manifests_name_our_kernels_as_their_sources_hash_now():
    """An entry whose kernel changed since it was recorded is skipped at start (that kernel then compiles in
    the start): editing a kernel means resettling the shipped manifests (ops/ship_kernel_manifest.py
    --resettle). Checked in a process of its own, without the interpreter these tests run Triton in (its
    functions have no source hash); fla's kernels are left out: one hashes a constant read from the GPU."""
    check = textwrap.dedent("""
        import json, pathlib, warnings
        warnings.simplefilter("ignore")
        from engine.kernels import manifest_store
        from engine.kernels.cache_keys import settle_kernel_keys
        settle_kernel_keys()
        shipped = sorted((pathlib.Path(manifest_store.__file__).parent / "manifests").glob("*.json"))
        assert shipped
        for manifest in shipped:
            for entry in json.loads(manifest.read_text())["kernels"]:
                if entry["module"].startswith("engine."):
                    source = manifest_store.resolve(entry["module"], entry["name"]).cache_key
                    if source != entry["source"]:
                        print("stale", manifest.name, entry["module"], entry["name"])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stale" not in done.stdout, done.stdout
