"""Speculative decoding with one MTP draft (`speculative=True`): greedy output equals decoding without drafts
token for token whatever the drafts are (the tiny model's own MTP drafts, and drafts forced right or wrong at
random, so both the accept and the reject paths run), in batches with chunked prefill, with `max_tokens` and EOS
ending inside an accepted pair; a rejected draft leaves no trace in the request's state (main model and MTP layer)
against an engine that never saw it; sampled tokens follow the target distribution (the verification on its own
over many draws, and the tiny model's tokens over many seeds against their exact distribution)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.mtp_drafter import MtpDrafter
from engine.sampler import _probs, verify_drafts
from engine.sequence import Sequence
from ops.bench_speculative import forcing_step
from tests.engine.conftest import random_prompt

PROMPTS = [random_prompt(40, 1), random_prompt(23, 2), random_prompt(31, 3)]


@pytest.fixture(scope="module")
def snapshot(tiny_dir):
    return tiny_dir("bf16", num_nextn_predict_layers=1)


def spec_llm(snapshot, **options) -> LLM:
    return LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, speculative=True,
               **{"max_num_batched_tokens": 16, **options})


def force_drafts(monkeypatch, truth: dict[tuple[int, ...], list[int]], right: float) -> None:
    monkeypatch.setattr(MtpDrafter, "step", forcing_step(truth, right, vocab=320))


def plain_outputs(snapshot, prompts, params) -> dict[tuple[int, ...], list[int]]:
    outputs = LLM(snapshot, dtype="float32", prefix_cache=False).generate(prompts, params)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}


def test_the_mtp_layers_own_drafts_change_no_token(snapshot):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = spec_llm(snapshot)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == list(plain_outputs(snapshot, PROMPTS, params).values())
    assert llm.core.stats().drafts.proposed > 0


def run_counting_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    seqs = [Sequence(str(i), list(p), params) for i, p in enumerate(prompts)]
    for seq in seqs:
        llm.core.add(seq)
    steps = 0
    while llm.core.has_work:
        llm.core.step()
        steps += 1
    return [s.output_token_ids for s in seqs], steps


@pytest.mark.parametrize("right", [1.0, 0.6, 0.0])
def test_forced_drafts_change_no_token_and_save_steps_when_right(snapshot, monkeypatch, right):
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)  # odd: a pair can end at the limit
    truth = plain_outputs(snapshot, PROMPTS, params)
    unverified = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=16,
                     max_num_seqs=3)
    _, unverified_steps = run_counting_steps(unverified, PROMPTS, params)
    force_drafts(monkeypatch, truth, right)
    llm = spec_llm(snapshot, max_num_seqs=3)
    outputs, steps = run_counting_steps(llm, PROMPTS, params)
    assert outputs == list(truth.values())
    stats = llm.core.stats().drafts
    if right == 1.0:
        assert stats.accepted == stats.proposed > 0
        assert steps <= unverified_steps - 5  # two tokens a step once decoding (12 decode steps -> 6)
    if right == 0.0:
        assert stats.accepted == 0 and stats.proposed > 0


def test_eos_inside_an_accepted_pair_ends_the_request(snapshot, monkeypatch):
    probe = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    answer = plain_outputs(snapshot, PROMPTS[:1], probe)[tuple(PROMPTS[0])]
    stop_at = answer[3]  # a stop token the 4th output reaches, drafted right
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    truth = plain_outputs(snapshot, PROMPTS[:1], params)
    force_drafts(monkeypatch, truth, right=1.0)
    out = spec_llm(snapshot).generate(PROMPTS[:1], params)[0]
    assert out.token_ids == truth[tuple(PROMPTS[0])] and out.finish_reason == "stop"


def slot_state(llm: LLM, seq: Sequence) -> list[torch.Tensor]:
    slots = llm.core.slots
    out = [slots.recurrent[:, seq.slot].clone(), slots.conv[:, seq.slot].clone(), slots.open_pool[:, seq.slot].clone()]
    drafter = llm.core.drafter
    if drafter is not None:
        out.append(drafter.caches.slots.open_pool[:, seq.slot].clone())
    return out


def test_a_rejected_draft_leaves_no_trace(snapshot, monkeypatch):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS[:1], params)
    force_drafts(monkeypatch, truth, right=0.0)
    # Drafts on, never verified: the state after the prefill step, the MTP layer's included.
    never = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=64)
    seq = Sequence("a", list(PROMPTS[0]), params)
    never.core.add(seq)
    never.core.step()  # the prompt, its first token sampled, a draft made
    want = slot_state(never, seq)
    llm = spec_llm(snapshot, max_num_batched_tokens=64)
    seq = Sequence("b", list(PROMPTS[0]), params)
    llm.core.add(seq)
    llm.core.step()
    assert seq.draft_token is not None
    computed = seq.num_computed
    llm.core.step()  # the verify: the (wrong) draft rejected
    assert seq.num_computed == computed and len(seq.output_token_ids) == 2
    for got, expected in zip(slot_state(llm, seq), want, strict=True):
        assert torch.equal(got, expected)


# Sampling: a draft is accepted with the probability the row gives it, else the token comes from the rest.
DRAWS = 20_000  # a frequency's standard deviation is at most 0.0035: 0.015 is over 4 of them


def test_verify_drafts_draws_from_the_rows_distribution():
    g = torch.Generator().manual_seed(0)
    row, draft_row = torch.randn(12, generator=g) * 2, torch.randn(12, generator=g) * 2
    seq = Sequence("s", [1], SamplingParams(temperature=0.8, top_k=6, seed=7))
    p, q = _probs(row, seq), _probs(draft_row, seq)
    for draft in (int(p.argmax()), int(p.argmin())):  # a likely draft, and one outside the top 6
        tokens, after = torch.zeros(12), torch.zeros(12)
        for _ in range(DRAWS):
            token, next_token = verify_drafts(row[None], draft_row[None], [seq], [draft])[0]
            tokens[token] += 1
            if next_token is not None:
                assert token == draft
                after[next_token] += 1
        assert (tokens / DRAWS - p).abs().max() < 0.015
        accepted = after.sum()
        assert abs(accepted / DRAWS - p[draft]) < 0.015
        if accepted:
            assert (after / accepted - q).abs().max() < 0.02
    greedy = Sequence("g", [1], SamplingParams(temperature=0.0))
    assert verify_drafts(row[None], draft_row[None], [greedy], [int(row.argmax())]) == [
        (int(row.argmax()), int(draft_row.argmax()))]


RUNS = 600


def test_sampled_tokens_follow_the_models_distribution(snapshot, monkeypatch):
    """The token a verify step samples, over many seeds, against its exact distribution given the token before
    it (drafts forced to each context's likeliest token, so acceptance and rejection both happen often)."""
    prompt = PROMPTS[1]
    params = [SamplingParams(max_tokens=2, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(RUNS)]
    plain = LLM(snapshot, dtype="float32", prefix_cache=False)
    probe = Sequence("p", prompt, params[0])
    support = _probs(plain.prompt_logits(prompt)[-1], probe).nonzero().flatten().tolist()
    exact = {t: _probs(plain.prompt_logits(prompt + [t])[-1], probe) for t in support}
    original = MtpDrafter.step

    def step(self, plan, result):
        original(self, plan, result)
        for span in plan.spans:
            if span.seq.draft_token is not None:
                span.seq.draft_token = int(exact[span.seq.output_token_ids[-1]].argmax())

    monkeypatch.setattr(MtpDrafter, "step", step)
    llm = spec_llm(snapshot, max_num_seqs=64, max_num_batched_tokens=2048, max_waiting=RUNS)
    outputs = llm.generate([prompt] * RUNS, params)
    seen = torch.bincount(torch.tensor([o.token_ids[1] for o in outputs]), minlength=320).float() / RUNS
    expected = sum(exact[o.token_ids[0]] for o in outputs) / RUNS
    # Sampling noise over these few cells: total variation ~0.03; a draft accepted regardless, or the rest
    # drawn with the draft still in it, moves it by 0.15 or more.
    assert 0.5 * (seen - expected).abs().sum() < 0.07
    stats = llm.core.stats().drafts
    assert 0 < stats.verified_accepted < stats.verified == RUNS
