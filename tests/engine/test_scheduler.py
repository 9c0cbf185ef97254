"""Continuous batching: chunked prefill under the token budget, bounded queue, aborts free resources."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore, EngineOptions
from engine.loading import load_engine
from engine.scheduler import QueueFull
from engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def core(snapshot, **options) -> EngineCore:
    return load_engine(snapshot, dtype="float32", options=EngineOptions(**options))


def test_long_prompt_does_not_stall_decodes(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    engine.add(Sequence("short", prompt(5, seed=1), GREEDY))
    engine.step()  # prefill of the short prompt, first token
    engine.add(Sequence("long", prompt(60, seed=2), GREEDY))
    plan = {span.seq.request_id: span.num_new for span in engine.scheduler.schedule().spans}
    # The decoding request gets its token; the long prompt takes the rest of the 16-token budget.
    assert plan == {"short": 1, "long": 15}


def test_a_lone_prompt_takes_the_prefill_budget_and_a_step_with_decodes_does_not(tiny_dir, prompt):
    """max_prefill_tokens: steps of prompts alone take up to it; once a request decodes, steps keep
    max_num_batched_tokens, so its tokens never wait on the longer chunk. The output is the same either way."""
    snapshot = tiny_dir("bf16")
    engine = core(snapshot, max_num_seqs=4, max_num_batched_tokens=16, max_prefill_tokens=48, max_model_len=256,
                  prefix_cache=False)  # no snapshot stops inside the prompt
    long = Sequence("long", prompt(100, seed=2), GREEDY)
    engine.add(long)
    computed = []
    while long.num_computed < 100:
        engine.step()
        computed.append(long.num_computed)
    assert computed == [48, 96, 100]
    engine.add(Sequence("next", prompt(60, seed=3), GREEDY))
    plan = {span.seq.request_id: span.num_new for span in engine.scheduler.schedule().spans}
    assert plan == {"long": 1, "next": 15}

    prompts = [prompt(n, seed=n) for n in (100, 7, 41)]
    lone = LLM(snapshot, dtype="float32", max_num_batched_tokens=8, max_prefill_tokens=64, max_num_seqs=3)
    plain = LLM(snapshot, dtype="float32", max_num_batched_tokens=8, max_num_seqs=3)
    assert [o.token_ids for o in lone.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_chunked_generation_equals_unchunked(tiny_dir, prompt):
    snapshot = tiny_dir("bf16")
    prompts = [prompt(n, seed=n) for n in (70, 3, 33)]
    small = LLM(snapshot, dtype="float32", max_num_batched_tokens=8, max_num_seqs=3)
    big = LLM(snapshot, dtype="float32")
    assert [o.token_ids for o in small.generate(prompts, GREEDY)] == [o.token_ids for o in big.generate(prompts, GREEDY)]


def test_every_step_decodes_every_running_request(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"), max_num_seqs=3, max_num_batched_tokens=12)
    for i in range(2):
        engine.add(Sequence(f"r{i}", prompt(4, seed=i), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    engine.step()
    engine.add(Sequence("big", prompt(50, seed=9), GREEDY))
    for _ in range(4):  # 'big' prefills in chunks of 10 while r0 and r1 keep producing
        produced = {o.request_id for o in engine.step()}
        assert {"r0", "r1"} <= produced


def test_queue_is_bounded(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"), max_num_seqs=1, max_waiting=2)
    for i in range(2):
        engine.add(Sequence(str(i), prompt(4, seed=i), GREEDY))
    with pytest.raises(QueueFull):
        engine.add(Sequence("x", prompt(4), GREEDY))
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add(Sequence("y", prompt(4), SamplingParams(max_tokens=9000)))


def test_abort_frees_slot_and_pages(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"), max_num_seqs=2)
    free = (engine.slots.free_count, engine.cache.free_pages)
    engine.add(Sequence("a", prompt(10), SamplingParams(max_tokens=50, temperature=0.0)))
    engine.add(Sequence("b", prompt(10, seed=3), SamplingParams(max_tokens=50, temperature=0.0)))
    engine.add(Sequence("c", prompt(10, seed=4), SamplingParams(max_tokens=50, temperature=0.0)))
    engine.step()
    assert engine.stats().running == 2 and engine.stats().waiting == 1
    assert engine.abort("a") and engine.abort("c") and not engine.abort("zzz")
    assert engine.stats().running == 1 and engine.stats().waiting == 0
    assert engine.abort("b")
    assert (engine.slots.free_count, engine.cache.free_pages) == free
