"""Prompt logprobs (what `/v1/completions` echoes with `echo` and `logprobs`): each prompt token's logprob under
the model, computed while the prompt is prefilled, in chunks, beside other requests and past a prefix cache
that holds the prompt, equal to transformers' log-softmax of the same positions."""

from __future__ import annotations

import pytest
import torch

from engine.engine_core import EngineCore, EngineOptions
from engine.loading import load_engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine.conftest import reference_outputs, run_together


def params(prompt_logprobs: int | None, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)


def core(snapshot, **options) -> EngineCore:
    return load_engine(snapshot, dtype="float32", options=EngineOptions(page_size=16, **options))


def expected(reference_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax rows [len - 1, V] that predict prompt tokens 1.. (float64)."""
    return torch.log_softmax(reference_outputs(reference_model, ids).logits.double(), dim=-1)[:-1]


def assert_prompt_logprobs(seq: Sequence, rows: torch.Tensor, k: int) -> None:
    ids = seq.prompt_token_ids
    assert len(seq.prompt_logprobs) == len(ids) - 1
    for position, (lp, row) in enumerate(zip(seq.prompt_logprobs, rows), start=1):
        assert lp.logprob == pytest.approx(float(row[ids[position]]), abs=2e-4), position
        top = torch.topk(row, k)
        assert [t for t, _ in lp.top] == top.indices.tolist(), position
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=2e-4)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-ct"])
def test_prompt_logprobs_match_the_reference_across_chunks_and_batches(fmt, tiny_dir, reference, prompt):
    snapshot = tiny_dir(fmt)
    engine = core(snapshot, max_num_batched_tokens=24)  # a 70-token prompt runs in several chunks
    long, short, other = prompt(70, seed=1), prompt(9, seed=2), prompt(40, seed=3)
    seqs = run_together(engine, [Sequence("long", long, params(3)), Sequence("other", other, params(None)),
                                 Sequence("short", short, params(0))])
    model = reference(snapshot)
    assert_prompt_logprobs(seqs[0], expected(model, long), 3)
    assert_prompt_logprobs(seqs[2], expected(model, short), 0)
    assert all(lp.top == [] for lp in seqs[2].prompt_logprobs)
    assert seqs[1].prompt_logprobs == []
    alone = run_together(core(snapshot), [Sequence("alone", long, params(None))])[0]
    assert seqs[0].output_token_ids == alone.output_token_ids  # asking for them changes nothing generated


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_dir, reference, prompt):
    """The prefix cache holds the whole prompt after a first request; one asking for prompt logprobs still gets
    every position (it skips the cache), and its continuation equals the cached request's."""
    snapshot = tiny_dir("bf16")
    engine = core(snapshot, prefix_cache=True)
    ids = prompt(50, seed=4)
    first = run_together(engine, [Sequence("first", ids, params(None))])[0]
    cached = run_together(engine, [Sequence("cached", ids, params(None))])[0]
    assert cached.cached_prompt_tokens > 0  # the cache did hold the prompt
    scored = run_together(engine, [Sequence("scored", ids, params(2))])[0]
    assert scored.cached_prompt_tokens == 0
    assert_prompt_logprobs(scored, expected(reference(snapshot), ids), 2)
    assert scored.output_token_ids == cached.output_token_ids == first.output_token_ids


def test_a_scored_prompt_runs_in_bounded_chunks(tiny_dir, prompt, monkeypatch):
    """Each prompt token scored brings a row of logits: such a prompt is prefilled PROMPT_LOGPROB_CHUNK tokens at
    a time whatever the step's budget, with the same logprobs."""
    from engine import scheduler

    snapshot, ids = tiny_dir("bf16"), prompt(45, seed=5)
    whole = run_together(core(snapshot), [Sequence("whole", ids, params(1))])[0]
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_CHUNK", 16)
    engine, chunks = core(snapshot), []
    seq = Sequence("chunked", ids, params(1))
    engine.add(seq)
    while engine.has_work:
        before = seq.num_computed
        engine.step()
        chunks.append(seq.num_computed - before)
    assert chunks[0] == max(chunks) == 16 and sum(chunks) == len(ids) + 3  # 4 tokens out: 3 of them run again
    assert [lp.logprob for lp in seq.prompt_logprobs] == pytest.approx([lp.logprob for lp in whole.prompt_logprobs],
                                                                       abs=1e-4)
    assert seq.output_token_ids == whole.output_token_ids


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny_dir):
    seq = run_together(core(tiny_dir("bf16")), [Sequence("one", [5], params(2))])[0]
    assert seq.prompt_logprobs == [] and len(seq.output_token_ids) == 4


def test_negative_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
