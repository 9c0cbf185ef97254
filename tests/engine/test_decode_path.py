"""The static decode path (one token per request, static shapes for CUDA graphs) against the span path."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from engine import LLM, SamplingParams
from engine.warm_up import graph_sizes
from engine.kernels.indexer.torch_ref import index_select
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.sampler import sample, sample_batch
from engine.sequence import Sequence
from engine.step_plan import StepPlan


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # No prefix cache: the tests drive the scheduler one step at a time, and a prefill must run whole.
    return LLM(tiny_dir("nvfp4-ct"), dtype="float32", max_model_len=256, prefix_cache=False)


def test_decode_steps_equal_teacher_forced_prefill(llm, prompt):
    """Each decode step's logits equal the span path's logits for the same position (one prefill of the
    whole text), across pool completions and past the sparse-selection length."""
    ids = prompt(90, seed=11)
    seq = Sequence("d", ids, SamplingParams(max_tokens=40))
    llm.scheduler.add(seq)
    rows = []
    try:
        for _ in range(26):
            logits = llm.core.teacher_forced_step(llm.scheduler.schedule())
            rows.append(logits[-1])
            seq.output_token_ids.append(int(logits[-1].argmax()))
    finally:
        llm.scheduler.finish(seq)
    full = llm.prompt_logits(ids + seq.output_token_ids[:-1])[len(ids) - 1:]
    ours = torch.stack(rows)
    assert ((ours - full).abs().amax(-1) / full.abs().amax(-1)).max() < 1e-4


def _caches(core) -> tuple[torch.Tensor, ...]:
    return (core.slots.recurrent, core.slots.conv, core.slots.open_pool, core.cache.latents, core.cache.pool_keys)


def caches_state(core) -> list[torch.Tensor]:
    return [t.clone() for t in _caches(core)]


def put_back(core, state: list[torch.Tensor]) -> None:
    for live, saved in zip(_caches(core), state):
        live.copy_(saved)


@contextmanager
def prefilled(llm, prompt, name: str, lengths: tuple[int, ...], seed: int, outputs: list[int]) -> Iterator[list]:
    """Requests with prompts of these lengths, prefilled in one step, each then given `outputs` (not yet
    computed); they leave the scheduler at the end."""
    seqs = [Sequence(f"{name}{i}", prompt(n, seed=seed + i), SamplingParams(max_tokens=8))
            for i, n in enumerate(lengths)]
    for seq in seqs:
        llm.scheduler.add(seq)
    try:
        llm.core.teacher_forced_step(llm.scheduler.schedule())  # prefill them all
        for seq in seqs:
            seq.output_token_ids.extend(outputs)
        yield seqs
    finally:
        for seq in seqs:
            llm.scheduler.finish(seq)


def test_padding_rows_on_scratch_state_change_nothing(llm, prompt):
    """A captured batch pads with the scratch slot and page: the real rows' logits stay the same."""
    with prefilled(llm, prompt, "p", (9, 40), seed=20, outputs=[7]) as seqs:
        core, dev = llm.core, llm.model.device
        max_pages = llm.runner.max_pages

        def step(pad: int) -> torch.Tensor:
            slots = [s.slot for s in seqs] + [core.slots.scratch_slot] * pad
            positions = [s.num_computed for s in seqs] + [0] * pad
            table = torch.full((len(slots), max_pages), core.cache.scratch_page, dtype=torch.long)
            for row, s in enumerate(seqs):
                table[row, :len(s.pages)] = torch.tensor(s.pages)
            tokens = torch.tensor([7] * len(slots), device=dev)
            meta = DecodeMeta(torch.tensor(slots, device=dev), torch.tensor(positions, device=dev), table.to(dev))
            state = caches_state(core)
            logits = llm.model.forward(ForwardBatch(tokens, [], meta), core.slots, core.cache,
                                       torch.arange(len(seqs), device=dev))
            put_back(core, state)  # undo, so the next call sees the same state
            return logits

        alone, padded = step(pad=0), step(pad=3)
        assert (padded - alone).abs().max() / alone.abs().max() < 1e-5  # matmul rounding differs with M


def test_mixed_and_decode_batches_equal_each_alone(llm, prompt):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [prompt(n, seed=30 + n) for n in (1, 5, 38, 90)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]


def request_state(core, seqs: list[Sequence], tokens: int) -> list[torch.Tensor]:
    """What the requests' next steps read once `tokens` more of theirs are computed: recurrent and conv state,
    the open pools' filled places, the latents and the complete pools' keys (places and pools still open are
    rewritten before they are read)."""
    slots, cache, kpool = core.slots, core.cache, core.slots.open_pool.shape[2]
    state = []
    for seq in seqs:
        total = seq.num_computed + tokens
        pages = torch.tensor([seq.pages])
        state += [slots.recurrent[:, seq.slot].clone(), slots.conv[:, seq.slot].clone(),
                  slots.open_pool[:, seq.slot, :total % kpool].clone(),
                  cache.latents[:, cache.rows_at(pages, torch.arange(total).unsqueeze(0))[0]].clone(),
                  cache.pool_keys[:, cache.pool_rows_at(pages, torch.arange(total // kpool).unsqueeze(0))[0]].clone()]
    return state


@pytest.mark.parametrize("unrun, drafts", [(1, 1), (1, 3), (2, 1)])
def test_a_verify_on_the_static_path_equals_the_span_path(llm, prompt, unrun, drafts):
    """Requests verifying the same number of drafts after their unrun tokens (one, or two: a rejection's
    tokens run again) run as one static-shape step (the verify graphs' path): its logits rows, and every state
    it leaves (recurrent, conv, open pools, latents, pooled keys), equal those of the same tokens run as spans;
    the rows cross an indexer pool's end (kpool 4) in one request."""
    with prefilled(llm, prompt, "v", (9, 30), seed=40, outputs=[7, 9][:unrun]) as seqs:
        plan = StepPlan.of([(seq, unrun) for seq in seqs])
        plan = dataclasses.replace(plan, drafts={seq: tuple(range(11, 11 + drafts)) for seq in seqs})
        assert plan.static_tokens == unrun + drafts
        core = llm.core
        before = caches_state(core)
        static = llm.runner.run(plan).logits
        after_static = request_state(core, seqs, unrun + drafts)
        put_back(core, before)
        spans = llm.runner.run(plan, layer_outputs=[]).logits
        assert static.shape == spans.shape == (len(seqs) * (1 + drafts), llm.config.vocab_size)
        torch.testing.assert_close(static, spans, rtol=1e-4, atol=1e-4)
        for got, want in zip(after_static, request_state(core, seqs, unrun + drafts), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_pool_ties_break_toward_earlier_pools_whatever_the_row_width():
    """Pools whose heads all clip to zero tie exactly; decode scans a wider row than prefill, so the
    tie must not be broken by position in the row."""
    q = -torch.ones(1, 2, 4)  # every score relu-clips to zero against positive keys
    keys = torch.ones(12, 4)
    weights = torch.ones(1, 2)
    position = torch.tensor([6 * 4 + 3])  # kpool 4: pools 0..6 complete
    one_page, two_pages = torch.tensor([[0]]), torch.tensor([[0, 1]])
    narrow = index_select(q, weights, keys, one_page, None, position, 7, 7, 4, select=3)
    wide = index_select(q, weights, keys, two_pages, None, position, 12, 6, 4, select=3)
    assert narrow.tolist() == wide.tolist() == [[0, 1, 2]]


def test_graph_sizes_cover_every_batch():
    assert graph_sizes(1) == (1,)
    assert graph_sizes(8) == (1, 2, 4, 8)
    assert graph_sizes(12) == (1, 2, 4, 8, 12)
    for n in range(1, 13):
        assert any(s >= n for s in graph_sizes(12))


def test_batched_sampling_equals_per_row_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = [Sequence(str(i), [1], SamplingParams(temperature=0.0)) for i in range(2)]
    seeded = [Sequence(str(i), [1], SamplingParams(temperature=0.8, top_p=0.9, seed=5)) for i in range(2, 4)]
    twins = [Sequence(str(i), [1], SamplingParams(temperature=0.8, top_p=0.9, seed=5)) for i in range(2, 4)]
    got = sample_batch(logits, greedy + seeded)
    assert [t for t, _ in got[:2]] == logits[:2].argmax(-1).tolist()
    assert [t for t, _ in got[2:]] == [sample(logits[i + 2], s)[0] for i, s in enumerate(twins)]
    unseeded = [Sequence("u", [1], SamplingParams(temperature=1.0, top_k=1))]  # top-k 1: must be the argmax
    assert sample_batch(logits[:1], unseeded)[0][0] == int(logits[0].argmax())
