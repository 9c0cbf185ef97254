"""The prefix cache on CUDA, with the fast kernels, decode graphs and a pinned host tier: greedy outputs equal
those of the same engine without the cache (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine.cache.state_rows import state_bytes
from engine.config import ModelConfig
from engine.engine_core import EngineCore, EngineOptions
from engine.loading import load_engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tiny.factory import write_tiny_model
from tests.engine.conftest import random_prompt, run_together

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

PAGE = 16


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    # Well conditioned: different prefill chunkings (cache on and off) round differently in TF32.
    return write_tiny_model(tmp_path_factory.mktemp("prefix"), "nvfp4-ct", well_conditioned=True)


def run(engine: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    seqs = [Sequence(f"{tag}{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    return [s.output_token_ids for s in run_together(engine, seqs)]


def test_cached_outputs_equal_uncached_on_cuda(snapshot):
    one = state_bytes(ModelConfig.from_dir(snapshot), PAGE, torch.float32)
    options = EngineOptions(max_num_seqs=4, page_size=PAGE, prefix_cache_bytes=2 * one,  # two device snapshots
                            prefix_cache_host_bytes=64 * one)
    cached = load_engine(snapshot, "cuda", "float32", options)
    plain = load_engine(snapshot, "cuda", "float32", EngineOptions(max_num_seqs=4, page_size=PAGE, prefix_cache=False))
    assert cached.runner.graphs is not None
    system = random_prompt(45, seed=1)
    first = [system + random_prompt(6 + i, seed=2 + i) for i in range(3)]
    outputs = run(cached, first, "a")
    assert outputs == run(plain, first, "a")
    second = [p + out + random_prompt(5, seed=10 + i) for i, (p, out) in enumerate(zip(first, outputs))]
    assert run(cached, second, "b") == run(plain, second, "b")
    same = second[0] + random_prompt(3, seed=20)
    assert run(cached, [same] * 3, "c") == run(plain, [same], "c") * 3
    stats = cached.prefix.stats()
    assert stats.hits == 2 + 3 + 3 and stats.evicted_snapshots > 0 and stats.host_snapshots > 0
