"""Grammar masks in engine steps where not every scheduled row samples: a prefill chunk that stops at a prefix-cache
snapshot runs in the step but has no logits row, so the constrained rows after it must be masked by their place
among the rows that do sample, and every request must answer as it does alone."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_plan import StepPlan
from engine.structured import GrammarSpec
from tests.engine.test_prefix_cache import PAGE, core, greedy, run

PATTERN = r"[a-f]{2}-[0-9]"
CHOICES = ["yes", "no"]


def constrained(grammar: GrammarSpec) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar)


def record_schedules(engine: EngineCore, monkeypatch: pytest.MonkeyPatch) -> list[StepPlan]:
    """Every plan the engine's scheduler hands its steps from now on, in order."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recorded() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    return plans


def test_constrained_rows_after_a_chunk_that_samples_nothing_are_masked_as_alone(tiny_dir, prompt, monkeypatch):
    """One step runs, in this order: a constrained decode, a prefill chunk that stops where its prompt leaves the
    cached pages (it samples nothing), a constrained prompt's first token and a free prompt's. The masks must
    follow the logits rows (one per sampling request), not the scheduled rows: every output is valid for its
    grammar and equals the request's output run alone."""
    snapshot = tiny_dir("bf16")
    engine, plain = core(snapshot), core(snapshot, prefix_cache=False)
    system = prompt(2 * PAGE + 5, seed=80)
    decoder = Sequence("decoder", prompt(6, seed=82), constrained(GrammarSpec("regex", PATTERN)))
    for seq in (Sequence("earlier", system + prompt(10, seed=81), greedy(1)), decoder):
        engine.add(seq)
    engine.step()  # the earlier request finishes, caching system's 2 full pages; the decoder decodes from here on
    branching = Sequence("branching", system + prompt(10, seed=83), greedy(2))
    chosen = Sequence("chosen", prompt(7, seed=84), constrained(GrammarSpec.choice(CHOICES)))
    free = Sequence("free", prompt(8, seed=85), greedy(2))
    for seq in (branching, chosen, free):
        engine.add(seq)
    plans = record_schedules(engine, monkeypatch)
    sampled = [out.request_id for out in engine.step()]
    assert [(span.seq.request_id, span.num_new) for span in plans[0].spans] == [
        ("decoder", 1), ("branching", 2 * PAGE), ("chosen", 7), ("free", 8)]
    assert sampled == ["decoder", "chosen", "free"]  # no logits row for the chunk that stopped at the branch point
    while engine.has_work:
        engine.step()
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    assert re.fullmatch(PATTERN, tokenizer.decode(decoder.output_token_ids)), decoder.output_token_ids
    assert tokenizer.decode(chosen.output_token_ids) in CHOICES, chosen.output_token_ids
    assert decoder.finish_reason == chosen.finish_reason == "stop"
    for seq in (decoder, branching, chosen, free):
        assert seq.output_token_ids == run(plain, [seq.prompt_token_ids], seq.params)[0], seq.request_id
