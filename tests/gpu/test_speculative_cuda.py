"""The MTP layer and speculative decoding on CUDA in bf16: the layer's logits within what bf16 (and the FP8 prefill's
quantized activations) loses on the CPU against the CPU's float32, and greedy output with k = 1 and 3 drafts verified equal to the same engine's
without, the prefix cache on (the MTP's own drafts, and drafts forced right or right at random, so the accept and
reject paths run). Runs only where a GPU is."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny.factory import write_tiny_model
from tests.engine.test_bf16 import rel_error
from tests.engine.test_mtp import engine_mtp, inputs, prefill
from tests.engine.test_speculative import PROMPTS, force_drafts
from tests.gpu.test_bf16_cuda import W8A8_FACTOR

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mtp-cuda"), "fp8", well_conditioned=True,
                            num_nextn_predict_layers=1)


def test_mtp_logits_on_cuda_within_bf16_error(snapshot):
    want_layer, want_caches, cfg = engine_mtp(snapshot, torch.float32)
    hidden, next_ids = inputs(cfg, seed=3)
    want = prefill(want_layer, want_caches, hidden, next_ids)
    base_layer, base_caches, _ = engine_mtp(snapshot, torch.bfloat16)
    base = prefill(base_layer, base_caches, hidden, next_ids)
    cuda_layer, cuda_caches, _ = engine_mtp(snapshot, torch.bfloat16, "cuda")
    got = prefill(cuda_layer, cuda_caches, hidden, next_ids)
    # The snapshot is FP8: its prefill on CUDA quantizes activations, as the main model's test allows for.
    assert rel_error(got, want) <= W8A8_FACTOR * rel_error(base, want), (rel_error(got, want), rel_error(base, want))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("right", [None, 1.0, 0.6])
def test_verified_greedy_output_on_cuda_equals_plain(snapshot, monkeypatch, right, k):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # The same step budget for both: a prefill chunk of more than 16 rows quantizes the FP8 linears' activations,
    # so both engines must cut the prompts alike.
    plain = LLM(snapshot, "cuda", "bfloat16", max_num_batched_tokens=16).generate(PROMPTS, params)
    if right is not None:
        force_drafts(monkeypatch, {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}, right)
    spec = LLM(snapshot, "cuda", "bfloat16", speculative_tokens=k, max_num_batched_tokens=16)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert spec.core.stats().drafts.verified > 0


@pytest.mark.parametrize("right", [1.0, 0.6])
def test_verify_graphs_equal_the_eager_verify(snapshot, monkeypatch, right):
    """Batches verifying k = 2 drafts each replay the verify graphs (1 + 2 tokens a request, at sizes 1 and 2):
    the same tokens as the same engine without graphs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(snapshot, "cuda", "bfloat16", cuda_graphs=False).generate(PROMPTS, params)
    force_drafts(monkeypatch, {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}, right)
    graphs = LLM(snapshot, "cuda", "bfloat16", speculative_tokens=2, max_num_seqs=4)
    eager = LLM(snapshot, "cuda", "bfloat16", speculative_tokens=2, max_num_seqs=4, cuda_graphs=False)
    assert {(1, 3), (2, 3), (4, 3)} <= set(graphs.runner.graphs.shapes)
    for prompts in (PROMPTS[:1], PROMPTS[:2]):
        assert [o.token_ids for o in graphs.generate(prompts, params)] == \
            [o.token_ids for o in eager.generate(prompts, params)]
    assert sum(count for (_, n), count in graphs.runner.graphs.replays.items() if n > 1) > 0
