"""Cached decode equals full recompute; a mixed batch equals each request alone; slots and pages are freed."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from tests.engine.conftest import count_kernel_calls


def test_prefill_then_decode_equals_full_recompute(tiny_dir, prompt):
    llm = LLM(tiny_dir("bf16"), dtype="float32", page_size=8)  # small pages: spans cross page borders
    ids = prompt(70, seed=5)
    full = llm.prompt_logits(ids)
    # Prefill 41 tokens, then feed the remaining 29 one at a time through the decode path.
    seq = Sequence(0, ids[:41], SamplingParams(max_tokens=40))
    assert llm.scheduler.try_admit(seq)
    logits = [llm.core.teacher_forced_step([(seq, 41)], all_rows=True)]
    for token in ids[41:]:
        seq.output_token_ids.append(token)
        logits.append(llm.core.teacher_forced_step([(seq, 1)]))
    llm.scheduler.finish(seq)
    stepped = torch.cat(logits)
    rel = (stepped - full).abs().max() / full.abs().max()
    assert rel < 1e-4, rel


def test_chunked_prefill_equals_one_prefill(tiny_dir, prompt):
    """Prefill continuing from cached state (chunks of uneven size) matches a single prefill."""
    llm = LLM(tiny_dir("bf16"), dtype="float32", page_size=8)
    ids = prompt(97, seed=6)
    full = llm.prompt_logits(ids)
    seq = Sequence(0, ids, SamplingParams(max_tokens=1))
    llm.scheduler.add(seq)
    llm.scheduler.schedule()  # admit: slot + pages
    parts, done = [], 0
    for size in (30, 1, 33, 33):
        parts.append(llm.core.teacher_forced_step([(seq, size)], all_rows=True))
        done += size
    llm.scheduler.finish(seq)
    assert done == len(ids)
    rel = (torch.cat(parts) - full).abs().max() / full.abs().max()
    assert rel < 1e-4, rel


def test_spans_of_one_step_equal_each_prefill_alone(tiny_dir, prompt):
    """One step continuing several prefills at once (each from mid-pool, across page borders) and a prompt's last
    token: every row equals a single prefill of that prompt, and the step runs its spans together: one short
    conv per KDA layer; per DSA layer one pooling, selection and attention for the spans and one decode pass
    for the lone token."""
    llm = LLM(tiny_dir("bf16"), dtype="float32", page_size=8, prefix_cache=False)
    prompts = [prompt(n, seed=40 + n) for n in (50, 61, 37, 20)]
    first = (13, 22, 6, 19)  # held pool keys: 13 % 4, 22 % 4, 6 % 4; the last one has 1 token left
    seqs = [Sequence(i, ids, SamplingParams(max_tokens=1)) for i, ids in enumerate(prompts)]
    for seq in seqs:
        assert llm.scheduler.try_admit(seq)
    for seq, n in zip(seqs, first):
        llm.core.teacher_forced_step([(seq, n)], all_rows=True)
    with count_kernel_calls(("short_conv_varlen", "index_pool", "index_select", "sparse_mla")) as calls:
        rest = [(seq, len(seq.prompt_token_ids) - n) for seq, n in zip(seqs, first)]
        rows = llm.core.teacher_forced_step(rest, all_rows=True)
    cfg = llm.core.config
    kda, dsa = len(cfg.kda_layers), len(cfg.dsa_layers)  # index_pool: the spans' pools, the lone token's pool
    assert calls == {"short_conv_varlen": kda, "index_pool": 2 * dsa, "index_select": 2 * dsa, "sparse_mla": 2 * dsa}
    for seq in seqs:
        llm.scheduler.finish(seq)
    start = 0
    for ids, n in zip(prompts, first):
        want = llm.prompt_logits(ids)[n:]
        got = rows[start:start + len(want)]
        start += len(want)
        assert (got - want).abs().max() / want.abs().max() < 1e-4


def test_mixed_batch_equals_each_alone(tiny_dir, prompt):
    snapshot = tiny_dir("nvfp4-ct")
    prompts = [prompt(n, seed=10 + n) for n in (3, 90, 17, 64, 41)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = LLM(snapshot, dtype="float32").generate(prompts, params)
    alone = LLM(snapshot, dtype="float32")
    for p, out in zip(prompts, batched):
        assert out.token_ids == alone.generate([p], params)[0].token_ids


def test_requests_release_slots_and_pages(tiny_dir, prompt):
    llm = LLM(tiny_dir("bf16"), dtype="float32", max_num_seqs=2, max_model_len=256)
    slots, pages = llm.scheduler.slots.free_count, llm.scheduler.cache.free_pages
    # Five requests through two slots: later ones wait for earlier ones to finish.
    outs = llm.generate([prompt(20, seed=i) for i in range(5)],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5] * 5
    assert all(o.finish_reason == "length" for o in outs)
    assert (llm.scheduler.slots.free_count, llm.scheduler.cache.free_pages) == (slots, pages)


def test_sampling_is_seeded_and_stops_on_eos(tiny_dir, prompt):
    llm = LLM(tiny_dir("bf16"), dtype="float32")
    ids = prompt(12, seed=7)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    assert llm.generate([ids], seeded)[0].token_ids == llm.generate([ids], seeded)[0].token_ids
    first = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    out = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first]))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_prefill_rows_are_a_view_only_where_they_are_every_row_in_order():
    """A step of prompts alone takes views of its activations; a step with a one-token row among them gathers."""
    from engine.model.batch import ForwardBatch, SeqSpan

    def step(*news: int) -> ForwardBatch:
        offsets = torch.tensor([0, *news]).cumsum(0).tolist()
        spans = [SeqSpan(offset, new, 0, slot, []) for slot, (offset, new) in enumerate(zip(offsets, news))]
        return ForwardBatch(token_ids=torch.zeros(sum(news), dtype=torch.long), spans=spans)

    assert step(5, 3).prefill_rows == slice(0, 8)
    mixed = step(5, 1, 3)
    assert torch.equal(mixed.prefill_rows, torch.tensor([0, 1, 2, 3, 4, 6, 7, 8]))
    assert torch.equal(step(1, 4).prefill_rows, torch.tensor([1, 2, 3, 4]))
