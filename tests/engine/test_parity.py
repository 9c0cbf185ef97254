"""The engine against transformers' glm5_next (float32, dequantized weights) for every weight format."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parity import compare_layers, first_divergent_layer
from tests.engine.conftest import load_reference, reference_outputs

FORMATS = ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"]
PROMPT_LEN = 90  # > index_topk + kpool - 1 = 35: sparse selection drops positions


def ref_logits(model, ids: list[int]) -> torch.Tensor:
    return reference_outputs(model, ids).logits


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 against fp32: the engine agrees to ~1e-5, so 1e-4 still catches a Sinkhorn pass too few."""
    rel = (ours - ref).abs().max() / ref.abs().max()
    cos = torch.nn.functional.cosine_similarity(ours.flatten().double(), ref.flatten().double(), dim=0)
    assert rel <= 1e-4, f"max|diff|/max|ref| = {rel:.3e}"
    assert cos >= 0.9999, f"cosine = {cos:.6f}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_logits_match_reference(fmt, tiny_dir, reference, prompt):
    snapshot = tiny_dir(fmt)
    ids = prompt(PROMPT_LEN, seed=1)
    ours = LLM(snapshot, dtype="float32").prompt_logits(ids)
    assert ours.shape == (PROMPT_LEN, 320) and ours.dtype == torch.float32
    assert_close(ours, ref_logits(reference(snapshot), ids))


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_continuation_matches_reference(fmt, tiny_dir, reference, prompt):
    snapshot = tiny_dir(fmt)
    ids = prompt(PROMPT_LEN, seed=2)
    out = LLM(snapshot, dtype="float32").generate([ids], SamplingParams(max_tokens=32, temperature=0.0,
                                                                       ignore_eos=True))[0]
    model, expected = reference(snapshot), []
    for _ in range(32):  # full recompute each step: the plainest possible reference
        expected.append(int(ref_logits(model, ids + expected)[-1].argmax()))
    assert out.token_ids == expected


def test_sparse_selection_matters(tiny_dir, prompt):
    """With a top-k that covers the whole prompt the indexer keeps everything: outputs must then differ."""
    ids = prompt(PROMPT_LEN, seed=3)
    sparse = LLM(tiny_dir("bf16"), dtype="float32").prompt_logits(ids)
    dense = LLM(tiny_dir("bf16", index_topk=256), dtype="float32").prompt_logits(ids)
    short = 35  # up to index_topk + kpool - 1 tokens, selection keeps every position
    assert torch.allclose(sparse[:short], dense[:short], rtol=1e-5, atol=1e-5)
    assert (sparse[short + 4:] - dense[short + 4:]).abs().max() > 1e-2


def test_layer_outputs_match_and_divergence_is_named(tiny_dir, reference, prompt):
    snapshot = tiny_dir("bf16")
    ids = prompt(48, seed=4)
    llm = LLM(snapshot, dtype="float32")
    ref_layers = reference_outputs(reference(snapshot), ids).layers
    ours = llm.layer_outputs(ids)
    assert first_divergent_layer(ours, ref_layers) is None
    assert all(d.cosine > 0.99999 for d in compare_layers(ours, ref_layers))

    llm.model.layers[5].ffn_hc.norm.mul_(1.01)  # a 1% weight error in one layer
    bad = first_divergent_layer(llm.layer_outputs(ids), ref_layers)
    assert bad is not None and bad.layer == 5


def test_transformers_loads_the_tiny_snapshot_as_written(tiny_dir, prompt):
    """The factory's sharded official layout is what transformers' own loader expects."""
    snapshot = tiny_dir("bf16")
    model = load_reference(snapshot, torch.float32)
    ids = prompt(40, seed=8)
    assert_close(LLM(snapshot, dtype="float32").prompt_logits(ids), ref_logits(model, ids))


def test_tiny_weights_exercise_routing_and_mixing(tiny_dir, prompt):
    """Routing spreads over experts and mHC mixes streams unevenly, so parity tests see real behaviour."""
    llm = LLM(tiny_dir("bf16"), dtype="float32")
    x = llm.model.embed[torch.tensor(prompt(64, seed=9))]
    streams = x.unsqueeze(1).expand(-1, 4, -1).contiguous()
    _, post, comb = llm.model.layers[1].ffn_hc.collapse(streams)
    assert (comb - 0.25).abs().max() > 0.2 and post.std() > 0.1
    ids, weights = llm.model.layers[1].mlp.router(x)
    assert ids.unique().numel() >= 12  # of 16 experts
    assert (weights.max(-1).values / weights.min(-1).values).median() > 1.15
