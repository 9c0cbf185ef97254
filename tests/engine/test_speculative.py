"""Speculative decoding with k = 1..3 MTP drafts (`speculative_tokens`): greedy output equals decoding without
drafts token for token whatever the drafts are (the tiny model's own MTP drafts, and drafts forced right or wrong
at random, so both the accept and the reject paths run), in batches with chunked prefill, with the prefix cache
on, with structured output (every verified row masked), with a stop token ending inside an accepted run and
`max_tokens` cutting the drafts; a rejected draft leaves
no trace in the request's state (main model and MTP layer) against an engine that never saw it; sampled tokens
follow the target distribution (the verification on its own over many draws, and the tiny model's tokens over
many seeds against their exact distribution)."""

from __future__ import annotations

import json
import math
import random
from typing import Callable

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from engine.mtp_drafter import MtpDrafter
from engine.sampler import _probs, verify_drafts
from engine.sequence import Sequence
from engine.step_plan import StepPlan
from engine.structured import GrammarSpec, Reasoning
from tests.engine.conftest import random_prompt
from tests.engine.test_structured import END_THINK, PERSON

PROMPTS = [random_prompt(40, 1), random_prompt(23, 2), random_prompt(31, 3)]
LONG = random_prompt(70, 4)  # past the tiny model's 64-token page: the prefix cache keeps it
VOCAB = 320


@pytest.fixture(scope="module")
def snapshot(tiny_dir):
    return tiny_dir("bf16", num_nextn_predict_layers=1)


def spec_llm(snapshot, k: int = 1, **options) -> LLM:
    """k drafts every step (the measured draft length has its own test)."""
    return LLM(snapshot, dtype="float32", **{"prefix_cache": False, "max_num_batched_tokens": 16,
                                             "speculative_tokens": k, "measured_draft_length": False, **options})


def forcing_step(truth: dict[tuple[int, ...], list[int]], right: float, vocab: int,
                 seed: int = 0) -> Callable[[MtpDrafter, StepPlan], None]:
    """An `MtpDrafter.draft` that, after the MTP layer drafted, replaces each draft by the right token (the one
    decoding without drafts gives for that request and position, from `truth`: prompt -> output) with
    probability `right`, else by a wrong one (drafts past the known answer are dropped)."""
    rng = random.Random(seed)
    original = MtpDrafter.draft

    def draft(self: MtpDrafter, plan: StepPlan) -> None:
        original(self, plan)
        for span in plan.spans:
            seq = span.seq
            answer = truth.get(tuple(seq.prompt_token_ids), [])
            position = len(seq.output_token_ids)
            seq.draft_tokens = tuple(answer[i] if rng.random() < right else (answer[i] + 1) % vocab
                                     for i in range(position, min(position + len(seq.draft_tokens), len(answer))))

    return draft


def force_drafts(monkeypatch, truth: dict[tuple[int, ...], list[int]], right: float) -> None:
    monkeypatch.setattr(MtpDrafter, "draft", forcing_step(truth, right, vocab=VOCAB))


def plain_outputs(snapshot, prompts, params, **options) -> dict[tuple[int, ...], list[int]]:
    outputs = LLM(snapshot, dtype="float32", **{"prefix_cache": False, **options}).generate(prompts, params)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_mtp_layers_own_drafts_change_no_token(snapshot, k):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = spec_llm(snapshot, k)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == list(plain_outputs(snapshot, PROMPTS, params).values())
    stats = llm.core.stats().drafts
    assert stats.proposed > 0 and stats.verify_steps > 0 and stats.verified >= stats.verify_steps


def test_longer_steps_for_prompts_alone_change_no_token(snapshot, monkeypatch):
    """max_prefill_tokens with drafts, some rejected (restored requests run tokens again): steps of prompts alone
    take the longer budget, steps beside generating requests keep 16, and every token is plain decoding's."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS, params)
    force_drafts(monkeypatch, truth, right=0.6)
    llm = spec_llm(snapshot, 2, max_prefill_tokens=64)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(truth.values())


def run_counting_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    seqs = [Sequence(str(i), list(p), params) for i, p in enumerate(prompts)]
    for seq in seqs:
        llm.core.add(seq)
    steps = 0
    while llm.core.has_work:
        llm.core.step()
        steps += 1
    return [s.output_token_ids for s in seqs], steps


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("right", [1.0, 0.6, 0.0])
def test_forced_drafts_change_no_token_and_save_steps_when_right(snapshot, monkeypatch, right, k):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # 11 after the prefill's: k + 1 cuts
    truth = plain_outputs(snapshot, PROMPTS, params)
    unverified = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=16,
                     max_num_seqs=3)
    _, unverified_steps = run_counting_steps(unverified, PROMPTS, params)
    force_drafts(monkeypatch, truth, right)
    llm = spec_llm(snapshot, k, max_num_seqs=3)
    outputs, steps = run_counting_steps(llm, PROMPTS, params)
    assert outputs == list(truth.values())
    stats = llm.core.stats().drafts
    if right == 1.0:
        assert stats.verified_accepted == stats.verified > 0
        assert stats.mean_accepted_length > 1 + 0.5 * k
        # 11 decode steps become ceil(11 / (k + 1)) for the request that decodes last (one step of slack: the
        # verify spans take more of the step's token budget while the others still prefill)
        assert steps <= unverified_steps - (11 - math.ceil(11 / (k + 1))) + 1
    if right == 0.0:
        assert stats.verified_accepted == 0 and stats.verified > 0


@pytest.mark.parametrize("right", [0.0, 0.6])
def test_after_a_rejection_a_step_keeps_its_k_plus_1_rows_on_the_static_path(snapshot, monkeypatch, right):
    """Rejections restore a request and run its tokens again: it gets fewer drafts, so once every request
    decodes, each step runs k + 1 rows a request (the verify graphs' shape), whatever was accepted before."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS, params)
    force_drafts(monkeypatch, truth, right)
    llm = spec_llm(snapshot, 2, max_num_seqs=3)
    seqs = [Sequence(str(i), list(p), params) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        llm.core.add(seq)
    shapes, run = [], llm.runner.run

    def counting(plan, *args, **kwargs):
        if all(span.seq.num_computed >= len(span.seq.prompt_token_ids) for span in plan.spans) and \
                len(plan.spans) == len(seqs):
            shapes.append((plan.static_tokens, {len(plan.drafts.get(span.seq, ())) for span in plan.spans}))
        return run(plan, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "run", counting)
    while llm.core.has_work:
        llm.core.step()
    assert [s.output_token_ids for s in seqs] == list(truth.values())
    assert llm.core.stats().drafts.verified > llm.core.stats().drafts.verified_accepted  # rejections happened
    steady = shapes[:-2]  # the last steps near max_tokens draft fewer
    assert len(steady) >= 3 and all(tokens == 3 for tokens, _ in steady), shapes
    assert any(drafts != {2} for _, drafts in steady), shapes  # some with fewer drafts after a rejection


@pytest.mark.parametrize("k", [1, 3])
def test_a_stop_token_inside_an_accepted_run_ends_the_request(snapshot, monkeypatch, k):
    probe = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    answer = plain_outputs(snapshot, [LONG], probe)[tuple(LONG)]
    stop_at = answer[2]  # reached inside the first verify step's accepted run for k = 3, the second's for k = 1
    assert stop_at not in answer[:2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    force_drafts(monkeypatch, {tuple(LONG): answer}, right=1.0)  # drafts run past the stop
    llm = spec_llm(snapshot, k, prefix_cache=True)
    out = llm.generate([LONG], params)[0]
    assert out.token_ids == answer[:3] and out.finish_reason == "stop"
    # The state the prefix cache kept at the finish is the request's own: a next turn answers as a plain engine.
    turn = LONG + out.token_ids + random_prompt(5, 9)
    again = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    monkeypatch.undo()
    got = llm.generate([turn], again)[0]
    assert got.num_cached_tokens > 0
    assert got.token_ids == plain_outputs(snapshot, [turn], again)[tuple(turn)]


def slot_state(llm: LLM, seq: Sequence) -> list[torch.Tensor]:
    """The request's recurrent, short-conv and open indexer-pool state (the MTP layer's pool is the last DSA
    index): the pool's places its computed positions fill; places past them, and latent pages past them, are
    rewritten before anything reads them."""
    slots = llm.core.slots
    filled = seq.num_computed % slots.open_pool.shape[2]
    return [slots.recurrent[:, seq.slot].clone(), slots.conv[:, seq.slot].clone(),
            slots.open_pool[:, seq.slot, :filled].clone()]


def state_after(llm: LLM, seq: Sequence, steps: int) -> list[torch.Tensor]:
    llm.core.add(seq)
    for _ in range(steps):
        llm.core.step()
    return slot_state(llm, seq)


@pytest.mark.parametrize("right_drafts", [0, 1])
def test_a_rejected_draft_leaves_no_trace(snapshot, monkeypatch, right_drafts):
    """Two drafts, the first (or the second) wrong: after the verify the state is the prefill's, bit for bit."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    answer = plain_outputs(snapshot, PROMPTS[2:], params)[tuple(PROMPTS[2])]
    never = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=64)
    want = state_after(never, Sequence("a", list(PROMPTS[2]), params), steps=1)  # the prompt, its first token
    assert want[2].shape[1] > 0  # 31 positions: 3 of an indexer pool's 4 places filled

    original = MtpDrafter.draft

    def draft(self, plan):
        original(self, plan)
        for span in plan.spans:
            position = len(span.seq.output_token_ids)
            if span.seq.draft_tokens and position + right_drafts < len(answer):
                right = answer[position:position + right_drafts]
                span.seq.draft_tokens = tuple(right) + ((answer[position + right_drafts] + 1) % VOCAB,)

    monkeypatch.setattr(MtpDrafter, "draft", draft)
    llm = spec_llm(snapshot, 2, max_num_batched_tokens=64)
    seq = Sequence("b", list(PROMPTS[2]), params)
    llm.core.add(seq)
    llm.core.step()
    assert len(seq.draft_tokens) == right_drafts + 1
    computed = seq.num_computed
    llm.core.step()  # the verify: a wrong draft rejected
    assert seq.num_computed == computed and seq.output_token_ids == answer[:2 + right_drafts]
    for got, expected in zip(slot_state(llm, seq), want, strict=True):
        assert torch.equal(got, expected)
    while llm.core.has_work:
        llm.core.step()
    assert seq.output_token_ids == answer


def test_an_accepted_run_leaves_the_state_of_its_tokens(snapshot, monkeypatch):
    """Three drafts, all right: after the verify the state is the one decoding them one by one leaves (the same
    positions, computed as one span instead of three steps: float32 rounding apart)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS[2:], params)
    never = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=64)
    want = state_after(never, Sequence("a", list(PROMPTS[2]), params), steps=5)  # 5 tokens, 4 of them computed
    force_drafts(monkeypatch, truth, right=1.0)
    llm = spec_llm(snapshot, 3, max_num_batched_tokens=64)
    seq = Sequence("b", list(PROMPTS[2]), params)
    got = state_after(llm, seq, steps=2)  # the prefill, then one verify of 3 drafts
    assert len(seq.output_token_ids) == 5 and seq.num_computed == seq.num_tokens - 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3])
def test_with_the_prefix_cache_on_turns_and_repeats_answer_as_without(snapshot, monkeypatch, k):
    """Conversation turns and a repeated prompt (n > 1's shape), drafts forced right at random: the MTP layer's
    state comes back with each snapshot, and verified drafts change no token."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = LLM(snapshot, dtype="float32", max_num_batched_tokens=16)
    first = [LONG, PROMPTS[1], LONG]
    want = [o.token_ids for o in plain.generate(first, params)]
    turns = [p + out + random_prompt(6, 20 + i) for i, (p, out) in enumerate(zip(first, want))]
    want_turns = [o.token_ids for o in plain.generate(turns, params)]
    force_drafts(monkeypatch, {tuple(p): out for p, out in zip(first + turns, want + want_turns)}, right=0.6)
    llm = spec_llm(snapshot, k, prefix_cache=True)
    assert [o.token_ids for o in llm.generate(first, params)] == want
    got_turns = llm.generate(turns, params)
    assert [o.token_ids for o in got_turns] == want_turns
    assert got_turns[0].num_cached_tokens > 64 and got_turns[2].num_cached_tokens > 64
    stats = llm.core.stats().drafts
    assert 0 < stats.verified_accepted < stats.verified


def drafts_made(llm: LLM, monkeypatch, prompt: list[int], params: SamplingParams) -> tuple[list, int]:
    """The MTP layer's own drafts for `prompt`, step by step, and the prompt tokens the prefix cache gave it."""
    made: list[tuple[int, ...]] = []
    original = MtpDrafter.draft

    def draft(self, plan):
        original(self, plan)
        made.extend(span.seq.draft_tokens for span in plan.spans if span.seq.draft_tokens)

    with monkeypatch.context() as patch:
        patch.setattr(MtpDrafter, "draft", draft)
        out = llm.generate([prompt], params)[0]
    return made, out.num_cached_tokens


def test_a_prefix_hit_brings_the_mtp_layers_state_back(snapshot, monkeypatch):
    """A turn started from a snapshot drafts what it drafts computed from scratch: the MTP layer's latents and
    open pool came back with the main model's."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = spec_llm(snapshot, 2, prefix_cache=True)
    answer = cached.generate([LONG], params)[0].token_ids
    turn = LONG + answer + random_prompt(6, 30)
    got, hit = drafts_made(cached, monkeypatch, turn, params)
    want, _ = drafts_made(spec_llm(snapshot, 2), monkeypatch, turn, params)
    assert hit > 64 and got == want and len(got) > 1


@pytest.mark.parametrize("k", [1, 3])
def test_structured_output_masks_every_verified_row(snapshot, monkeypatch, k):
    """A JSON schema, and a reasoning budget then a choice: greedy output equals decoding without drafts (drafts
    right at random, the wrong ones mostly outside the grammar), and sampled output still validates."""
    prompts = [list(f"prompt {i}".encode()) for i in range(3)]
    cases = [SamplingParams(max_tokens=60, temperature=0.0, grammar=GrammarSpec.json_schema(PERSON)),
             SamplingParams(max_tokens=30, temperature=0.0, grammar=GrammarSpec.choice(["yes", "no"]),
                            reasoning=Reasoning(END_THINK, 8))]
    for params in cases:
        truth = plain_outputs(snapshot, prompts, params)
        with monkeypatch.context() as patch:
            patch.setattr(MtpDrafter, "draft", forcing_step(truth, 0.6, vocab=VOCAB))
            llm = spec_llm(snapshot, k)
            assert [o.token_ids for o in llm.generate(prompts, params)] == list(truth.values())
        stats = llm.core.stats().drafts
        assert 0 < stats.verified_accepted < stats.verified
    sampled = SamplingParams(max_tokens=160, temperature=1.0, seed=11, grammar=GrammarSpec.json_schema(PERSON))
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    for out in spec_llm(snapshot, k).generate(prompts, sampled):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), PERSON)


@pytest.mark.parametrize("k", [1, 3])
def test_under_hybrid_offload_the_mtp_experts_are_placed_like_any_layers(tiny_dir, monkeypatch, k):
    """A budget of two experts a layer, the MTP layer's counted (FP8: the budget is read in the checkpoint's
    bytes): its experts are split between device slots and the host bank like the others', and verified greedy
    output equals the all-resident engine's."""
    snapshot = tiny_dir("fp8", num_nextn_predict_layers=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS, params)
    probe = LLM(snapshot, dtype="float32", moe_vram_budget=0, speculative_tokens=k)
    per_expert, layers = probe.core.offload.expert_bytes, len(probe.core.offload.layers)
    assert layers == len(probe.config.moe_layers) + 1 and probe.config.num_layers in probe.core.offload.layers
    force_drafts(monkeypatch, truth, right=0.6)
    llm = spec_llm(snapshot, k, moe_vram_budget=2 * per_expert * layers)
    assert {len(r) for r in llm.core.offload.resident.values()} == {2}
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(truth.values())
    assert 0 < llm.core.stats().drafts.verified_accepted < llm.core.stats().drafts.verified
    assert llm.core.stats().offload.host_pairs > 0


def test_an_nvfp4_release_under_hybrid_offload_drafts_with_its_mtp_experts_resident(tiny_dir, monkeypatch, caplog):
    """The NVFP4 releases keep the MTP layer's experts in FP8 blocks, a format hybrid offload's staging and CPU
    kernels do not share with the decoder layers': the loader keeps them whole on the device, the memory plan
    counts them as device bytes (two slots a layer of the decoder layers' budget stay two), the resident
    executor runs them, and verified greedy output equals decoding without drafts."""
    snapshot = tiny_dir("nvfp4-ct", num_nextn_predict_layers=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS, params)
    probe = LLM(snapshot, dtype="float32", moe_vram_budget=0)
    per_expert, layers = probe.core.offload.expert_bytes, len(probe.config.moe_layers)
    force_drafts(monkeypatch, truth, right=0.6)
    with caplog.at_level("INFO", logger="glmflash.engine"):
        llm = spec_llm(snapshot, 2, moe_vram_budget=2 * per_expert * layers)
    assert llm.core.offload is not None and llm.core.drafter is not None
    assert llm.config.num_layers not in llm.core.offload.layers
    assert {len(r) for r in llm.core.offload.resident.values()} == {2}
    assert "event=mtp_drafts on=1" in caplog.text and "experts=resident" in caplog.text
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(truth.values())
    assert 0 < llm.core.stats().drafts.verified_accepted < llm.core.stats().drafts.verified
    assert llm.core.stats().offload.host_pairs > 0


def test_a_measured_draft_length_changes_no_token(snapshot, monkeypatch):
    """Each step's draft length chosen from measured costs (every k from 3 down to 0 timed first): the same
    tokens as decoding without drafts."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    truth = plain_outputs(snapshot, PROMPTS, params)
    force_drafts(monkeypatch, truth, right=0.6)
    llm = spec_llm(snapshot, 3, measured_draft_length=True, max_num_batched_tokens=128)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(truth.values())
    length = llm.core.drafter.length
    assert {k for (_, k) in length.times} == {0, 1, 2, 3} and sum(length.tried) > 0


# Sampling: a draft is accepted with the probability its row gives it, else the token comes from the rest.
DRAWS = 20_000


def close(freq: torch.Tensor, p: torch.Tensor, n: float) -> bool:
    """Frequencies over n draws within 4.5 standard deviations (at most 0.5 / sqrt(n) each) of p."""
    return bool((freq - p).abs().max() < 4.5 * 0.5 / math.sqrt(n))


def test_verify_drafts_draws_each_position_from_its_rows_distribution():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 12, generator=g) * 3
    seq = Sequence("s", [1], SamplingParams(temperature=0.8, top_k=6, seed=7))
    p = [_probs(row, seq) for row in rows]
    for drafts in ((int(p[0].argmax()), int(p[1].argmax())), (int(p[0].argmin()), int(p[1].argmax()))):
        counts = [torch.zeros(12) for _ in range(3)]  # the token at each position, where it was drawn
        for _ in range(DRAWS):
            tokens = verify_drafts([rows], [seq], [drafts])[0]
            assert tokens[:-1] == list(drafts[:len(tokens) - 1])  # the accepted drafts, then one drawn
            for j, token in enumerate(tokens):
                counts[j][token] += 1
        assert close(counts[0] / DRAWS, p[0], DRAWS)
        assert close(counts[1].sum() / DRAWS, p[0][drafts[0]], DRAWS)
        for j in (1, 2):  # given the drafts before it accepted, each position follows its own row
            if counts[j].sum():
                assert close(counts[j] / counts[j].sum(), p[j], counts[j].sum())
        if counts[1].sum():
            assert close(counts[2].sum() / counts[1].sum(), p[1][drafts[1]], counts[1].sum())
    greedy = Sequence("g", [1], SamplingParams(temperature=0.0))
    best = rows.argmax(dim=-1).tolist()
    assert verify_drafts([rows], [greedy], [tuple(best[:2])]) == [best]
    assert verify_drafts([rows], [greedy], [(best[0], (best[1] + 1) % 12)]) == [best[:2]]


RUNS = 600


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_tokens_follow_the_models_distribution(snapshot, monkeypatch, k):
    """The token a verify step samples after the first, over many seeds, against its exact distribution given the
    token before it (the first draft forced to each context's likeliest token, so acceptance and rejection both
    happen often)."""
    prompt = PROMPTS[1]
    params = [SamplingParams(max_tokens=2 + k, temperature=1.0, top_k=4, seed=i, ignore_eos=True)
              for i in range(RUNS)]
    plain = LLM(snapshot, dtype="float32", prefix_cache=False)
    probe = Sequence("p", prompt, params[0])
    support = _probs(plain.prompt_logits(prompt)[-1], probe).nonzero().flatten().tolist()
    exact = {t: _probs(plain.prompt_logits(prompt + [t])[-1], probe) for t in support}
    original = MtpDrafter.draft

    def draft(self, plan):
        original(self, plan)
        for span in plan.spans:
            seq = span.seq
            if len(seq.output_token_ids) == 1 and seq.draft_tokens:
                seq.draft_tokens = (int(exact[seq.output_token_ids[0]].argmax()),) + seq.draft_tokens[1:]

    monkeypatch.setattr(MtpDrafter, "draft", draft)
    llm = spec_llm(snapshot, k, max_num_seqs=64, max_num_batched_tokens=2048, max_waiting=RUNS)
    outputs = llm.generate([prompt] * RUNS, params)
    seen = torch.bincount(torch.tensor([o.token_ids[1] for o in outputs]), minlength=VOCAB).float() / RUNS
    expected = sum(exact[o.token_ids[0]] for o in outputs) / RUNS
    # Sampling noise over these few cells: total variation ~0.03; a draft accepted regardless, or the rest
    # drawn with the draft still in it, moves it by 0.15 or more.
    assert 0.5 * (seen - expected).abs().sum() < 0.07
    stats = llm.core.stats().drafts
    assert stats.verify_steps >= RUNS and 0 < stats.verified_accepted < stats.verified
