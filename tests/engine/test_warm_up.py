"""The config-only warm-up starts in the background, once per shapes, and the engine waits on it."""

from __future__ import annotations

import threading

import torch

from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.warm_up import start_warm_up, warm_up_prefills
from engine.loading import load_engine
from engine.kernels.background import OncePerKey
from engine.kernels.kda import fla_prefill
from engine.tiny.factory import tiny_config


def test_the_kda_warm_up_runs_on_its_own_thread_once_per_shapes(monkeypatch):
    release, calls = threading.Event(), []

    def tune(device, heads, dim, dtype):
        calls.append((threading.current_thread().name, heads, dim, dtype))
        assert release.wait(10)

    monkeypatch.setattr(fla_prefill, "warm_up_kda_prefill", tune)
    monkeypatch.setattr(fla_prefill, "_warm_ups", OncePerKey("kda-warm-up"))
    first = fla_prefill.start_kda_warm_up("cpu", 3, 32, torch.bfloat16)
    assert not first.done()  # the caller goes on (reads weights) while it tunes
    assert fla_prefill.start_kda_warm_up("cpu", 3, 32, torch.bfloat16) is first
    other = fla_prefill.start_kda_warm_up("cpu", 3, 64, torch.bfloat16)
    release.set()
    first.result(10), other.result(10)
    assert sorted(c[1:] for c in calls) == [(3, 32, torch.bfloat16), (3, 64, torch.bfloat16)]
    assert all(c[0].startswith("kda-warm-up") for c in calls)


def test_nothing_to_warm_on_the_cpu():
    done = start_warm_up(ModelConfig.from_dict(tiny_config()), torch.device("cpu"), torch.float32)
    assert done.done() and done.result() is None


def test_the_kda_warm_up_waits_for_the_kernel_preload_whatever_its_outcome(monkeypatch):
    """The preload compiles the same kernels the tuning would: the tuning starts once it is done, also when
    it failed (a failed preload leaves the kernels to their first call, it never stops the start)."""
    from concurrent.futures import Future

    calls = []
    monkeypatch.setattr(fla_prefill, "warm_up_kda_prefill", lambda *args: calls.append(args))
    monkeypatch.setattr(fla_prefill, "_warm_ups", OncePerKey("kda-warm-up"))
    preload: Future = Future()
    tuning = fla_prefill.start_kda_warm_up("cpu", 3, 32, torch.bfloat16, after=preload)
    assert not tuning.done() and not calls
    preload.set_exception(RuntimeError("no driver"))
    tuning.result(10)
    assert calls == [("cpu", 3, 32, torch.bfloat16)]


def test_the_prefill_warm_up_leaves_an_idle_engine_that_answers_as_a_fresh_one(tiny_dir, prompt, caplog):
    """On a GPU the start prefills one prompt of each tile size (their compiles happen then); the engine is
    idle after, every slot free, and a request gets the tokens a fresh engine gives."""
    from engine.engine_core import EngineOptions
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from tests.engine.conftest import run_together

    def engine() -> EngineCore:
        return load_engine(tiny_dir("nvfp4-ct"), dtype="float32", options=EngineOptions(max_num_batched_tokens=128))

    warmed, ids = engine(), prompt(30, seed=7)
    with caplog.at_level("INFO", logger="glmflash.engine"):
        warm_up_prefills(warmed)
    assert "event=prefill_warm_up lengths=128" in caplog.text  # the longest first
    assert not warmed.has_work and warmed.stats().slots_used == 0
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = run_together(warmed, [Sequence("after", ids, params)])[0]
    assert got.cached_prompt_tokens == 0  # random warm-up prompts share nothing with requests
    assert got.output_token_ids == run_together(engine(), [Sequence("fresh", ids, params)])[0].output_token_ids

def test_a_start_whose_preload_covered_the_last_warm_up_skips_its_prefills(tiny_dir, caplog, monkeypatch):
    """Where the preload read every kernel of a manifest whose start ran the prefill warm-up under the same
    signature, those prefills would compile nothing: none runs, and the record is kept for the next start."""
    from engine import warm_up as warm_up_module
    from engine.engine_core import EngineOptions
    from engine.kernels.kernel_manifest import CompileLog

    core = load_engine(tiny_dir("nvfp4-ct"), dtype="float32", options=EngineOptions(max_num_batched_tokens=128))
    signature = {"longest": 128, "hybrid": False, "kv_cache_dtype": "auto", "drafts": 0}
    compiles = CompileLog(earlier_warm_up={"signature": signature, "lengths": [128, 29, 3]}, preloaded_all=True)
    monkeypatch.setattr(warm_up_module, "COMPILES", compiles)
    steps = []
    monkeypatch.setattr(core, "step", lambda *a, **k: steps.append(1))
    with caplog.at_level("INFO", logger="glmflash.engine"):
        warm_up_prefills(core)
    assert "event=prefill_warm_up skipped=kernels_preloaded lengths=128,29,3" in caplog.text and steps == []
    assert compiles.warmed == {"signature": signature, "lengths": [128, 29, 3]}
    compiles.preloaded_all = False  # a kernel the preload could not read: the prefills run and are recorded
    monkeypatch.undo()  # the engine's own steps again
    monkeypatch.setattr(warm_up_module, "COMPILES", compiles)
    caplog.clear()
    with caplog.at_level("INFO", logger="glmflash.engine"):
        warm_up_prefills(core)
    assert "event=prefill_warm_up lengths=128" in caplog.text and "skipped" not in caplog.text
    assert compiles.warmed["signature"] == signature and compiles.warmed["lengths"][0] == 128
