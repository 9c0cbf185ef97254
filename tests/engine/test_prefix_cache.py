"""Prefix cache: the hash chain, shared reference-counted pages, the copy-on-write boundary page, LRU eviction
(to host RAM or dropped), and greedy outputs with the cache equal to those without it, token for token."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch

from engine.cache import PagedLatents
from engine.cache.state_rows import state_bytes
from engine.engine_core import EngineCore, EngineOptions
from engine.loading import load_engine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine.conftest import run_together

FORMATS = ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"]
PAGE = 16  # 4 pools of 4 per page: prompts of a few dozen tokens span several pages
_ids = itertools.count()


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def core(snapshot, dtype: str = "float32", **options) -> EngineCore:
    return load_engine(snapshot, dtype=dtype, options=EngineOptions(page_size=PAGE, **options))


def submit(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | None = None) -> list[Sequence]:
    """Submit the prompts together and step until all are done."""
    return run_together(engine, [Sequence(str(next(_ids)), list(p), params or greedy()) for p in prompts])


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    """Output tokens of prompts submitted together."""
    return [seq.output_token_ids for seq in submit(engine, prompts, params)]


def run_each(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    """One prompt at a time, each after the previous one finished (a conversation's turns)."""
    return [run(engine, [p], params)[0] for p in prompts]


class Greedy(NamedTuple):
    seq: Sequence
    logprobs: torch.Tensor  # [output tokens, vocab]: each output token's log-probabilities over the whole vocabulary


def distributions(engine: EngineCore, prompt_ids: list[int], max_tokens: int = 4) -> Greedy:
    """Greedy run of one prompt alone, with every output token's full distribution (greedy tokens alone hide much:
    the tiny model's argmax follows the last few tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=engine.config.vocab_size)
    seq = Sequence(str(next(_ids)), list(prompt_ids), params)
    engine.add(seq)
    rows = []
    while engine.has_work:
        rows += [sorted(out.logprobs.top) for out in engine.step() if out.request_id == seq.request_id]
    return Greedy(seq, torch.tensor([[logprob for _, logprob in row] for row in rows]))


# Log-probabilities, cache on against off. float32: equal to rounding (measured on CPU: bit-identical). bf16: where
# a prefill chunk starts changes bf16's rounding: measured on the well-conditioned model over 9 prompts x 3 kinds of
# hit, <= 0.18 nats (<= 0.08 on test_restored_state_gives_the_uncached_distributions' prompts); a restore without the
# conv rows, from another snapshot's row or one token off moves a token by >= 1.6 nats, one without its boundary page
# by 0.34 on those prompts.
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.2}


def assert_distributions_close(got: Greedy, want: Greedy, tolerance: float) -> None:
    """Each output token's log-probabilities within `tolerance` nats of the reference's, through the first token
    the two runs chose differently (bf16 may flip a near-tie; after it the histories differ)."""
    pairs = list(zip(got.seq.output_token_ids, want.seq.output_token_ids))
    rows = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs) - 1) + 1
    worst = (got.logprobs[:rows] - want.logprobs[:rows]).abs().amax(dim=-1)  # per token, over the vocabulary
    assert bool((worst <= tolerance).all()), f"log-probabilities off by {worst.tolist()} nats (tolerance {tolerance})"


def no_leaks(engine: EngineCore) -> None:
    """Every page is free or held by the cache alone; every slot is free."""
    held = engine.prefix.stats().device_pages
    assert engine.cache.free_pages + held == engine.cache.num_pages
    assert engine.slots.free_count == engine.slots.num_slots


# --- pages and the chain -----------------------------------------------------------------------------


def test_pages_are_freed_when_their_last_holder_releases(tiny_dir):
    from engine.config import ModelConfig

    cache = PagedLatents(ModelConfig.from_dir(tiny_dir("bf16")), 4, PAGE, torch.device("cpu"), torch.float32)
    pages = cache.allocate(2)
    cache.share(pages[:1])
    cache.release(pages)
    assert cache.free_pages == 3 and cache.holders(pages[0]) == 1
    cache.release(pages[:1])
    assert cache.free_pages == 4 and cache.holders(pages[0]) == 0


def test_chain_matches_whole_pages_after_equal_parents(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"))
    a = prompt(50, seed=1)  # pages [0,16) [16,32) [32,48) and 2 more tokens
    out = run(engine, [a], greedy(4))[0]
    prefix = engine.prefix
    assert prefix.lookup(a[:40] + prompt(20, seed=2)).matched == 2
    assert prefix.lookup(a).matched == 3
    # The same tokens as a's second page, after a different first page: not the same prefix.
    assert prefix.lookup(prompt(16, seed=3) + a[16:50]).matched == 0
    # Snapshots: one token before the prompt's end and where the request finished (prompt + 3 generated).
    assert prefix.lookup(a + out + [7]).position == 53
    assert prefix.lookup(a[:49] + [7, 7]).position == 49
    assert prefix.lookup(a[:48] + [7, 7]).position == 0  # truncated to the last snapshot: none below 49
    no_leaks(engine)


def cache_two_chains(engine: EngineCore, prompt) -> tuple[list[int], list[int], list[int]]:
    """Cache a chain of one page a0 (a snapshot right after it) and one of two pages b0 -> b1 (snapshots 7 and 8
    tokens into b's third page); return (a0, b, a0 + b1 + b's tail + one token): a prompt whose second page equals b1
    at the same depth, under another parent."""
    a, b = prompt(PAGE + 1, seed=72), prompt(2 * PAGE + 8, seed=71)
    assert a[PAGE] != b[PAGE]  # a's snapshot at its end (a0 + 1 token) is no prefix of the mixed prompt either
    run_each(engine, [a, b], greedy(1))
    return a[:PAGE], b, a[:PAGE] + b[PAGE:] + [5]


def test_chain_match_stops_at_a_page_whose_parent_differs(tiny_dir, prompt):
    """A page is the same prefix only after the same parent: a0 + b1 matches a0 alone and restores a0's snapshot,
    nothing of b's chain (test_chain_matches_whole_pages_after_equal_parents changes the first page, so the parent
    of a deeper one is never checked)."""
    engine = core(tiny_dir("bf16"))
    a0, b, mixed = cache_two_chains(engine, prompt)
    a_chain, b_chain = engine.prefix.lookup(a0 + [0, 0]).blocks, engine.prefix.lookup(b).blocks
    assert (len(a_chain), len(b_chain)) == (1, 2)
    hit = engine.prefix.lookup(mixed)
    assert hit.matched == 1 and hit.blocks == a_chain and set(hit.blocks).isdisjoint(b_chain)
    assert hit.position == PAGE and hit.snapshot is not None and hit.snapshot.block is a_chain[0]


def test_a_page_under_another_parent_is_computed_not_restored(tiny_dir, prompt):
    """The engine restores only a0 for a0 + b1 + ...: b1's page and b's snapshot hold b0's context, and restoring
    them would answer as if the prompt began with b0."""
    snapshot = tiny_dir("bf16")
    engine, plain = core(snapshot), core(snapshot, prefix_cache=False)
    _, _, mixed = cache_two_chains(engine, prompt)
    want = distributions(plain, mixed)
    got = distributions(engine, mixed)
    assert got.seq.cached_prompt_tokens == PAGE
    assert_distributions_close(got, want, LOGPROB_TOLERANCE["float32"])
    # Its own pages now follow a0 in the chain (not b's b1): the same prompt again restores them.
    again = distributions(engine, mixed)
    assert again.seq.cached_prompt_tokens == len(mixed) - 1
    assert_distributions_close(again, want, LOGPROB_TOLERANCE["float32"])
    no_leaks(engine)


def test_mid_page_hits_copy_the_boundary_page(tiny_dir, prompt):
    """Two requests continue one snapshot that ends mid-page: each writes its own copy of that page."""
    snapshot = tiny_dir("bf16")
    engine, plain = core(snapshot), core(snapshot, prefix_cache=False)
    base = prompt(40, seed=4)  # snapshot at 39 = 2 pages + 7 tokens
    run(engine, [base], greedy(2))
    snap = engine.prefix.lookup(base[:39] + [1, 2]).snapshot
    assert snap is not None and len(snap.tail) == 7
    saved = engine.prefix.states.page.latents[snap.row].clone()
    branches = [base[:39] + prompt(20, seed=5), base[:39] + prompt(25, seed=6)]
    outputs = run(engine, branches)
    assert outputs == [run(plain, [b])[0] for b in branches]
    assert engine.prefix.stats().hit_tokens == 2 * 39
    assert torch.equal(engine.prefix.states.page.latents[snap.row], saved)  # the snapshot's page is untouched
    no_leaks(engine)


def test_branch_point_gets_a_snapshot(tiny_dir, prompt):
    """A prompt that leaves the cached chain leaves a snapshot where it did, for the prompts after it."""
    engine = core(tiny_dir("bf16"))
    shared = prompt(37, seed=7)
    run(engine, [shared + prompt(10, seed=8)], greedy(2))
    assert engine.prefix.lookup(shared + prompt(10, seed=9)).position == 0  # no snapshot at or below 37
    run(engine, [shared + prompt(10, seed=9)], greedy(2))  # matches 2 pages: pauses at 32 for a snapshot
    assert engine.prefix.lookup(shared + prompt(10, seed=10)).position == 32


# --- eviction ------------------------------------------------------------------------------------


def snapshot_bytes(engine_or_snapshot) -> int:
    from engine.config import ModelConfig

    return state_bytes(ModelConfig.from_dir(engine_or_snapshot), PAGE, torch.float32)


def test_least_recently_used_snapshot_is_evicted_first(tiny_dir, prompt):
    snapshot = tiny_dir("bf16")
    engine = core(snapshot, prefix_cache_bytes=2 * snapshot_bytes(snapshot))  # room for two snapshots
    assert engine.prefix.states.rows == 2
    a = prompt(30, seed=11)
    run(engine, [a], greedy(1))  # snapshots at 29 (prompt end - 1) and 30 (finished)
    run(engine, [a[:29] + [5]], greedy(1))  # hits 29, touching it; its own end (30, other tail) evicts a's end
    stats = engine.prefix.stats()
    assert (stats.hits, stats.evicted_snapshots, stats.device_snapshots) == (1, 1, 2)
    assert engine.prefix.lookup(a + [1]).position == 29
    assert engine.prefix.lookup(a[:29] + [5, 1]).position == 30


def test_least_recently_used_pages_are_evicted_when_the_pool_runs_short(tiny_dir, prompt):
    snapshot = tiny_dir("bf16")
    # One request's worth of pages (4) and no extra pages for the cache: cached pages compete for the pool.
    engine = core(snapshot, max_num_seqs=1, max_model_len=4 * PAGE, prefix_cache_bytes=2 * snapshot_bytes(snapshot))
    assert engine.cache.num_pages == 4
    a, b = prompt(20, seed=12), prompt(20, seed=13)
    run_each(engine, [a, b], greedy(4))  # each leaves its first page cached
    assert engine.prefix.stats().device_pages == 2
    run(engine, [a[:19] + [3, 4]], greedy(2))  # uses a's prefix: b's page is now the least recently used
    run(engine, [prompt(40, seed=14)], greedy(8))  # needs 3 pages, 2 free: one cached page goes
    stats = engine.prefix.stats()
    assert stats.evicted_pages == 1
    assert engine.prefix.lookup(a).matched == 1 and engine.prefix.lookup(b).matched == 0
    no_leaks(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_host_tier_takes_evictions_and_serves_hits(tiny_dir, prompt, kv_cache_dtype):
    snapshot = tiny_dir("nvfp4-ct")
    one = snapshot_bytes(snapshot)
    sizes = dict(max_num_seqs=1, max_model_len=4 * PAGE, kv_cache_dtype=kv_cache_dtype)
    engine = core(snapshot, prefix_cache_bytes=one, prefix_cache_host_bytes=64 * one, **sizes)
    plain = core(snapshot, prefix_cache=False, **sizes)
    a, b = prompt(36, seed=15), prompt(40, seed=16)
    turns = [a, b, a[:35] + [9, 9], b[:39] + [8, 8, 8]]
    assert run_each(engine, turns, greedy(6)) == run_each(plain, turns, greedy(6))
    stats = engine.prefix.stats()
    assert stats.evicted_pages > 0 and stats.evicted_snapshots > 0
    assert stats.hits == 2 and stats.hit_tokens == 35 + 39  # both from state that had moved to host RAM
    assert stats.host_snapshots > 0
    no_leaks(engine)


# --- equality with the cache off -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_cached_outputs_equal_uncached(tiny_dir, prompt, fmt):
    """A shared system prompt, conversation turns, mid-page hits, concurrent requests sharing a prefix and
    identical prompts at once: every greedy output equals the one computed without the cache."""
    snapshot = tiny_dir(fmt)
    engine, plain = core(snapshot), core(snapshot, prefix_cache=False)
    system = prompt(45, seed=20)
    # Concurrent: three conversations open at once on the same system prompt.
    first = [system + prompt(6 + i, seed=21 + i) for i in range(3)]
    seqs = submit(engine, first, greedy(6))
    outputs = [s.output_token_ids for s in seqs]
    assert outputs == run(plain, first, greedy(6))  # a batch equals each request alone (test_batching)
    assert [s.cached_prompt_tokens for s in seqs] == [0, 45, 45]  # mid-page: 2 pages and 13 tokens
    # Next turns: each conversation's history plus a new message.
    second = [p + out + prompt(5, seed=30 + i) for i, (p, out) in enumerate(zip(first, outputs))]
    seqs = submit(engine, second, greedy(6))
    assert [s.output_token_ids for s in seqs] == run(plain, second, greedy(6))
    assert all(s.cached_prompt_tokens == len(p) + 5 for s, p in zip(seqs, first))  # where the first turn stopped
    # Identical prompts at once (n > 1).
    same = second[0] + prompt(3, seed=40)
    assert run(engine, [same] * 3, greedy(6)) == run(plain, [same], greedy(6)) * 3
    assert engine.prefix.stats().hits == 2 + 3 + 3
    no_leaks(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restored_state_gives_the_uncached_distributions(tiny_dir, prompt, dtype):
    """A repeated prompt (the snapshot before its last token) and a conversation's next turn (the snapshot where
    the first turn stopped), both mid-page: every output token's distribution is the one without a cache, in bf16
    too (on the well-conditioned model: the default one turns bf16 rounding into different tokens)."""
    snapshot = tiny_dir("bf16", well_conditioned=True)
    engine, plain = core(snapshot, dtype), core(snapshot, dtype, prefix_cache=False)
    tolerance = LOGPROB_TOLERANCE[dtype]
    first = prompt(43, seed=96)
    want = distributions(plain, first)
    done = distributions(engine, first)  # no hit; the snapshot before its last token is saved mid-step
    assert_distributions_close(done, want, tolerance)
    # Another prompt in between: the page and slot the first one freed now hold other tokens' state, which a
    # restore that skipped a part would keep.
    run(engine, [prompt(43, seed=146)], greedy(4))
    again = distributions(engine, first)
    assert again.seq.cached_prompt_tokens == 42
    assert_distributions_close(again, want, tolerance)
    turn = first + done.seq.output_token_ids + prompt(5, seed=97)
    after = distributions(engine, turn)
    assert after.seq.cached_prompt_tokens == 43 + 3  # where the first turn stopped: its last output token never ran
    assert_distributions_close(after, distributions(plain, turn), tolerance)
    no_leaks(engine)


def test_identical_prompts_at_once_prefill_once(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"))
    p = prompt(70, seed=50)
    outputs = run(engine, [p] * 4)
    assert all(out == outputs[0] for out in outputs)
    stats = engine.prefix.stats()
    assert stats.computed_prompt_tokens == 70 + 3  # once, then the last token of each other copy


def test_requests_sharing_a_prefix_at_once_compute_it_once(tiny_dir, prompt):
    engine = core(tiny_dir("bf16"))
    system = prompt(50, seed=51)
    run(engine, [system + prompt(12, seed=52 + i) for i in range(3)])
    assert engine.prefix.stats().hit_tokens == 2 * 50  # the later two wait for the first to reach 50


def test_abort_of_a_sharing_request_leaves_the_others_intact(tiny_dir, prompt):
    snapshot = tiny_dir("bf16")
    engine, plain = core(snapshot), core(snapshot, prefix_cache=False)
    system = prompt(50, seed=60)
    run(engine, [system + [1]], greedy(1))  # caches the system prompt
    others = [system + prompt(8, seed=61 + i) for i in range(3)]
    seqs = [Sequence(f"s{i}", p, greedy(12)) for i, p in enumerate(others)]
    for seq in seqs:
        engine.add(seq)
    for _ in range(4):
        engine.step()
    shared_page = seqs[0].pages[0]
    assert all(s.pages[0] == shared_page for s in seqs) and engine.cache.holders(shared_page) == 4
    assert engine.abort("s1")
    while engine.has_work:
        engine.step()
    assert engine.cache.holders(shared_page) == 1  # the cache's own hold
    for i in (0, 2):
        assert seqs[i].output_token_ids == run(plain, [others[i]], greedy(12))[0]
    no_leaks(engine)


def test_a_prompts_last_token_runs_in_its_chunks_step_with_the_snapshot_before_it(tiny_dir, prompt):
    """The snapshot one token before the prompt's end costs no step of its own: the chunk runs through the last
    token (beside a decoding request) and the state before it is saved partway through the step; an identical
    prompt then restores that snapshot and both answer as without a cache."""
    engine, plain = core(tiny_dir("bf16")), core(tiny_dir("bf16"), prefix_cache=False)
    decoder = Sequence("decoder", prompt(5, seed=1), greedy(20))
    engine.add(decoder)
    engine.step()
    text = prompt(40, seed=2)
    first = Sequence("first", text, greedy(4))
    engine.add(first)
    outputs = {o.request_id for o in engine.step()}
    assert outputs == {"decoder", "first"} and first.num_computed == 40  # the whole prompt in one step
    again = Sequence("again", text, greedy(4))
    engine.add(again)
    while engine.has_work:
        engine.step()
    assert again.cached_prompt_tokens == 39
    want = run(plain, [text], greedy(4))[0]
    assert first.output_token_ids == again.output_token_ids == want
    assert decoder.output_token_ids == run(plain, [decoder.prompt_token_ids], greedy(20))[0]
    no_leaks(engine)


def test_a_held_back_token_runs_in_a_decode_step_when_its_chunk_fills_the_step(tiny_dir, prompt):
    """No room for the last token in its chunk's step: the prefill stops one token short for its snapshot, and
    that token runs with the decodes alone (a decode step), not beside another request's prefill chunk, which
    starts in the step after."""
    engine = core(tiny_dir("bf16"), max_num_batched_tokens=40, max_num_seqs=4)
    decoder = Sequence("decoder", prompt(5, seed=1), greedy(20))
    engine.add(decoder)
    engine.step()
    held = Sequence("held", prompt(40, seed=2), greedy(4))
    engine.add(held)
    engine.step()
    assert held.num_computed == 39 and not held.output_token_ids  # stopped at its snapshot
    engine.add(Sequence("new", prompt(30, seed=3), greedy(4)))
    plan = {span.seq.request_id: span.num_new for span in engine.scheduler.schedule().spans}
    assert plan == {"decoder": 1, "held": 1}
    outputs = {o.request_id for o in engine.step()}
    assert outputs == {"decoder", "held"}
    # Now the new prompt's chunk (through its last token, its snapshot saved before it) runs beside the decodes.
    plan = {span.seq.request_id: span.num_new for span in engine.scheduler.schedule().spans}
    assert plan == {"decoder": 1, "held": 1, "new": 30}
