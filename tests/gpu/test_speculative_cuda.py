"""The MTP layer and speculative decoding on CUDA: the layer's bf16 logits within what bf16 (and the FP8 prefill's
quantized activations) loses on the CPU against the CPU's float32; greedy output with k = 1 and 3 drafts verified
exactly the plain engine's in float32, and in bf16 parting from it only at near-ties; verify graphs the eager
verify's tokens; the prefix cache on (the MTP's own drafts, and drafts forced right or right at random, so the
accept and reject paths run); the MTP layer's graphs the eager layer's drafts. Runs only where a GPU is."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.mtp_drafter import MtpDrafter
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


@pytest.fixture(scope="module")
def bf16_snapshot(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mtp-cuda-bf16"), "bf16", well_conditioned=True,
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


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def cuda_llm(snapshot, dtype: str, **options) -> LLM:
    """The same step budget for every engine (a prefill chunk of more than 16 rows quantizes the FP8 linears'
    activations) and drafts of fixed length (the measured chooser would make runs depend on timing)."""
    return LLM(snapshot, "cuda", dtype, **{"max_num_batched_tokens": 16, "measured_draft_length": False, **options})


def outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("right", [None, 1.0, 0.6])
def test_verified_greedy_output_on_cuda_equals_plain(snapshot, monkeypatch, right, k):
    """In float32 on CUDA (the Triton kernels, verify graphs and all) greedy tokens are exactly the plain engine's:
    a verify's spans and the plain decode's steps round alike there, so any difference is a wrong state."""
    plain = outputs(cuda_llm(snapshot, "float32"), PROMPTS)
    if right is not None:
        force_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, plain)}, right)
    spec = cuda_llm(snapshot, "float32", speculative_tokens=k)
    assert outputs(spec, PROMPTS) == plain
    assert spec.core.stats().drafts.verified > 0


def test_verified_bf16_output_departs_from_plain_only_at_near_ties(bf16_snapshot, monkeypatch):
    """In bf16 a verify's rows and a decode's round differently (other GEMM shapes, chunked against recurrent
    KDA; drafts also move prompt chunk bounds), so greedy tokens may part where two candidates are within
    rounding: where a request's output first departs from the plain engine's, the two tokens' bf16 logits
    (the plain engine's, after the common part) lie within twice that position's bf16 error against float32.
    A bf16 snapshot: an FP8 one's long prefill would also quantize activations."""
    snapshot = bf16_snapshot
    plain_llm = cuda_llm(snapshot, "bfloat16")
    plain = outputs(plain_llm, PROMPTS)
    force_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, plain)}, 0.6)
    spec = cuda_llm(snapshot, "bfloat16", speculative_tokens=3)
    reference = cuda_llm(snapshot, "float32")
    for prompt, want, got in zip(PROMPTS, plain, outputs(spec, PROMPTS)):
        part = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if part is None:
            continue
        context = prompt + want[:part]
        logits, exact = plain_llm.prompt_logits(context)[-1], reference.prompt_logits(context)[-1]
        margin = (logits[want[part]] - logits[got[part]]).item()
        bound = 2 * (logits - exact).abs().max().item()
        assert margin <= bound, (part, margin, bound)
    assert spec.core.stats().drafts.verified > 0


@pytest.mark.parametrize("right", [1.0, 0.6])
def test_verify_graphs_equal_the_eager_verify(snapshot, monkeypatch, right):
    """Batches verifying k = 2 drafts each replay the verify graphs (1 + 2 tokens a request, at sizes 1 and 2): in
    bf16, the same tokens as the same engine without graphs (the same kernels on the same shapes)."""
    truth = dict(zip(map(tuple, PROMPTS), outputs(cuda_llm(snapshot, "bfloat16", cuda_graphs=False), PROMPTS)))
    graphs = cuda_llm(snapshot, "bfloat16", speculative_tokens=2, max_num_seqs=4)
    eager = cuda_llm(snapshot, "bfloat16", speculative_tokens=2, max_num_seqs=4, cuda_graphs=False)
    assert {(1, 3), (2, 3), (4, 3)} <= set(graphs.runner.graphs.shapes)
    for prompts in (PROMPTS[:1], PROMPTS[:2]):
        force_drafts(monkeypatch, truth, right)  # each engine the same wrong drafts
        with_graphs = outputs(graphs, prompts)
        force_drafts(monkeypatch, truth, right)
        assert with_graphs == outputs(eager, prompts)
    assert sum(count for (_, n), count in graphs.runner.graphs.replays.items() if n > 1) > 0


def recorded_drafts(monkeypatch) -> list[list[tuple[int, ...]]]:
    """Every step's drafts (each request's, in span order), appended as the engine makes them."""
    made: list[list[tuple[int, ...]]] = []
    original = MtpDrafter.draft

    def draft(self: MtpDrafter, plan) -> None:
        original(self, plan)
        made.append([span.seq.draft_tokens for span in plan.spans])

    monkeypatch.setattr(MtpDrafter, "draft", draft)
    return made


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_graphs_draft_what_the_eager_layer_drafts(snapshot, monkeypatch, k):
    """The MTP layer replayed from its graphs (the follow of decode and verify steps, the chain's one-token steps;
    3 requests in a graph of 4) makes the eager layer's drafts, step for step, in float32."""
    made = recorded_drafts(monkeypatch)
    graphs = cuda_llm(snapshot, "float32", speculative_tokens=k, max_num_seqs=4)
    with_graphs = outputs(graphs, PROMPTS)
    drafts = list(made)
    made.clear()
    eager = cuda_llm(snapshot, "float32", speculative_tokens=k, max_num_seqs=4, cuda_graphs=False)
    assert outputs(eager, PROMPTS) == with_graphs
    assert made == drafts and any(any(step) for step in drafts)
    replays = graphs.core.drafter.graphs.replays
    assert sum(count for (_, n), count in replays.items() if n == k + 1) > 0  # follows of verify steps
    if k > 1:
        assert sum(count for (_, n), count in replays.items() if n == 1) > 0  # the chain's steps


def test_an_nvfp4_release_under_hybrid_offload_drafts_on_cuda(tmp_path, monkeypatch):
    """The NVFP4 release's MTP layer (FP8-block experts) under hybrid offload on CUDA: its stacks whole on the
    device beside the decoder layers' split ones, run by the resident executor inside the MTP graphs, the
    decoder layers' misses on the CPU and the link; verified greedy output (k = 2) equals plain hybrid decoding
    in float32."""
    snapshot = write_tiny_model(tmp_path, "nvfp4-ct", well_conditioned=True, num_nextn_predict_layers=1)
    probe = cuda_llm(snapshot, "float32", moe_vram_budget=0)
    budget = 2 * probe.core.offload.expert_bytes * len(probe.config.moe_layers)
    plain = outputs(cuda_llm(snapshot, "float32", moe_vram_budget=budget), PROMPTS)
    force_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, plain)}, 0.6)
    spec = cuda_llm(snapshot, "float32", moe_vram_budget=budget, speculative_tokens=2)
    mtp = spec.config.num_layers
    assert spec.core.drafter is not None and mtp not in spec.core.offload.layers
    mtp_experts = spec.core.drafter.layer.mlp.experts  # the resident executor over the MTP layer's whole stacks
    assert mtp_experts is not spec.core.offload
    assert all(t.is_cuda for stack in mtp_experts.stacks[mtp] for t in vars(stack).values()
               if isinstance(t, torch.Tensor))
    assert outputs(spec, PROMPTS) == plain
    assert spec.core.stats().drafts.verified_accepted > 0 and spec.core.stats().offload.host_pairs > 0
