"""Decode replayed from CUDA graphs against the same engine run eagerly (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny.factory import write_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("graphs"), "nvfp4-ct")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_decode_equals_eager(snapshot, dtype):
    ids = torch.randint(0, 283, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphs = LLM(snapshot, "cuda", dtype, max_num_seqs=4)
    eager = LLM(snapshot, "cuda", dtype, max_num_seqs=4, cuda_graphs=False)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    for prompts in ([ids], [ids[:n] for n in (90, 7)], [ids[:n] for n in (90, 7, 40, 1)]):  # graph sizes 1, 2, 4
        assert [o.token_ids for o in graphs.generate(prompts, params)] == \
            [o.token_ids for o in eager.generate(prompts, params)]


def test_mixed_prefill_and_decode_equal_each_alone(snapshot):
    ids = torch.randint(0, 283, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(snapshot, "cuda", "float32", max_num_seqs=4, max_num_batched_tokens=64)  # prompts prefill in chunks
    prompts = [ids[:n] for n in (90, 3, 50, 1)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]
