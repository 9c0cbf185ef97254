"""Sampler: greedy, penalties, the filtered distribution, seeds and logprobs, each checked against a
plain float64 reference written here (not against the engine's own formulas)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from engine.sampler import _probs, _probs_rows, apply_penalties, sample, sample_batch
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

V = 64


def make_seq(prompt=(1, 2, 3), out=(), **params) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(**params))
    seq.output_token_ids = list(out)
    return seq


def rand_logits(seed: int, n: int = V, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).float()


def ref_penalties(logits, prompt, out, rep=1.0, presence=0.0, frequency=0.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).copy()
    for t in set(prompt) | set(out):  # HF: every seen id once, whatever its count
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    counts = Counter(out)  # OpenAI: generated tokens only
    for t, c in counts.items():
        x[t] -= frequency * c + presence * (c > 0)
    return x


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k:
        kth = sorted(x, reverse=True)[min(top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(len(p), dtype=bool)
    if min_p:
        keep &= p >= min_p * p.max()
    if top_p < 1.0:  # smallest best-first prefix whose mass reaches top_p (on the same distribution)
        mass = 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            keep[i] &= mass < top_p
            mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def engine_probs(logits, **params) -> np.ndarray:
    p = _probs(logits, make_seq(**params)).double().numpy()
    return p / p.sum()


# 1. greedy

@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = rand_logits(seed)
    token, lp = sample(logits, make_seq(temperature=0.0, top_k=3, top_p=0.1))
    assert token == int(np.argmax(logits.numpy())) and lp is None


def test_penalties_change_greedy_choice():
    logits = torch.full((8,), -5.0)
    logits[0], logits[1] = 3.0, 2.9
    assert sample(logits, make_seq(prompt=[5], temperature=0))[0] == 0
    assert sample(logits, make_seq(prompt=[0], temperature=0, repetition_penalty=1.1))[0] == 1  # 3/1.1 < 2.9
    assert sample(logits, make_seq(prompt=[0], temperature=0, repetition_penalty=1.02))[0] == 0  # 3/1.02 > 2.9
    # a prompt token is not penalised by presence/frequency (generated tokens only)
    assert sample(logits, make_seq(prompt=[0], temperature=0, presence_penalty=1.0))[0] == 0
    assert sample(logits, make_seq(prompt=[5], out=[0], temperature=0, presence_penalty=0.2))[0] == 1
    assert sample(logits, make_seq(prompt=[5], out=[0], temperature=0, frequency_penalty=0.06))[0] == 0
    assert sample(logits, make_seq(prompt=[5], out=[0, 0], temperature=0, frequency_penalty=0.06))[0] == 1
    neg = torch.tensor([-1.0, -1.05, -9.0])  # negative logits are multiplied: -1 * 1.1 < -1.05
    assert sample(neg, make_seq(prompt=[0], temperature=0, repetition_penalty=1.1))[0] == 1


# 2. penalties

@pytest.mark.parametrize("rep,presence,frequency", [
    (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4), (1.0, -0.5, 0.3), (1.2, 0.5, 0.25)])
@pytest.mark.parametrize("seed", range(3))
def test_apply_penalties_matches_reference(rep, presence, frequency, seed):
    g = torch.Generator().manual_seed(100 + seed)
    logits = rand_logits(seed)
    prompt = torch.randint(0, V // 2, (20,), generator=g).tolist()  # repeats, partly overlapping the output
    out = torch.randint(V // 4, V, (30,), generator=g).tolist()
    seq = make_seq(prompt=prompt, out=out, repetition_penalty=rep, presence_penalty=presence,
                   frequency_penalty=frequency)
    before = logits.clone()
    got = apply_penalties(logits, seq)
    assert torch.equal(logits, before), "apply_penalties must not modify its input (logprobs read the raw logits)"
    np.testing.assert_allclose(got.double().numpy(), ref_penalties(before, prompt, out, rep, presence, frequency),
                               rtol=1e-6, atol=1e-5)


# 3. the sampling distribution

@pytest.mark.parametrize("cfg", [
    dict(), dict(temperature=0.5), dict(temperature=2.0), dict(top_k=1), dict(top_k=5), dict(top_k=V + 10),
    dict(top_p=0.9), dict(top_p=0.3, temperature=0.7), dict(min_p=0.05), dict(min_p=0.3, temperature=1.5),
    dict(top_k=10, top_p=0.8), dict(top_k=10, min_p=0.1), dict(top_p=0.7, min_p=0.02),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01)], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_probs_match_reference(cfg, seed):
    logits = rand_logits(seed)
    np.testing.assert_allclose(engine_probs(logits, **cfg), ref_probs(logits, **cfg), atol=1e-6)


@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.76, 4), (0.2, 1), (0.3, 2)])
def test_top_p_exact_boundary(top_p, kept):
    # four equal tokens (exactly 0.25 each in fp32): a prefix whose mass equals top_p already reaches it
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, -math.inf, -math.inf])
    assert (ref_probs(logits, top_p=top_p) > 0).sum() == kept
    assert (engine_probs(logits, top_p=top_p) > 0).sum() == kept


def test_top_p_tie_straddling_boundary_keeps_one():
    # 0.4, 0.3, 0.3 with top_p=0.5: token 0 plus exactly one of the tied pair
    logits = torch.tensor([0.4, 0.3, 0.3]).log()
    p = engine_probs(logits, top_p=0.5)
    assert p[0] > 0 and (p[1:] > 0).sum() == 1
    np.testing.assert_allclose(sorted(p), [0.0, 0.3 / 0.7, 0.4 / 0.7], atol=1e-6)


def test_empirical_frequencies():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    seq = make_seq(seed=1234, temperature=0.9, top_k=5)
    expected = ref_probs(logits, temperature=0.9, top_k=5)
    n = 20_000
    draws = Counter(sample(logits, seq)[0] for _ in range(n))
    freq = np.array([draws[i] / n for i in range(6)])
    assert draws[5] == 0  # cut by top_k
    np.testing.assert_allclose(freq, expected, atol=0.015)


MIXED = [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(top_p=0.8), dict(min_p=0.2, top_k=40),
         dict(temperature=0.9, top_k=3, top_p=0.7, min_p=0.05), dict(temperature=0.0)]


def test_rows_of_a_batch_get_each_their_own_distribution():
    """One batched filter over rows with different parameters equals each row's own (the reference's)."""
    logits = torch.stack([rand_logits(40 + i) for i in range(len(MIXED))])
    sampled = [i for i, cfg in enumerate(MIXED) if cfg.get("temperature", 1.0) > 0]
    got = _probs_rows(logits[sampled], [make_seq(**MIXED[i]) for i in sampled]).double().numpy()
    for row, i in enumerate(sampled):
        np.testing.assert_allclose(got[row] / got[row].sum(), ref_probs(logits[i], **MIXED[i]), atol=1e-6)


def test_a_batch_draws_its_unseeded_rows_in_one_draw_with_each_rows_frequencies():
    """sample_batch: greedy rows take the argmax, sampled rows their own filtered distribution."""
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    logits = torch.stack([base, base.flip(0), base * 2, base])
    cfgs = [dict(temperature=0.9, top_k=5), dict(top_p=0.9), dict(temperature=0.0), dict(min_p=0.3)]
    seqs = [make_seq(**cfg) for cfg in cfgs]
    n = 8_000
    counts = [Counter() for _ in seqs]
    for _ in range(n):
        for row, (token, logprobs) in enumerate(sample_batch(logits, seqs)):
            counts[row][token] += 1
            assert logprobs is None
    assert counts[2] == Counter({int(logits[2].argmax()): n})
    for row in (0, 1, 3):
        freq = np.array([counts[row][i] / n for i in range(6)])
        np.testing.assert_allclose(freq, ref_probs(logits[row], **cfgs[row]), atol=0.02)


# 4. seeds

def draws(seq, logit_stream):
    return [sample(x, seq)[0] for x in logit_stream]


def test_seeded_reproducible_and_distinct():
    stream = [rand_logits(i, scale=0.5) for i in range(40)]
    assert draws(make_seq(seed=7), stream) == draws(make_seq(seed=7), stream)
    flat = [torch.zeros(V)] * 40
    assert draws(make_seq(seed=7), flat) != draws(make_seq(seed=8), flat)


def test_seeded_draws_ignore_interleaved_sequences():
    stream = [rand_logits(i, scale=0.5) for i in range(30)]
    alone_a = draws(make_seq(seed=1, top_p=0.9), stream)
    alone_b = draws(make_seq(seed=2, temperature=1.3), stream)
    a, b = make_seq(seed=1, top_p=0.9), make_seq(seed=2, temperature=1.3)
    other = make_seq()  # unseeded: uses the global generator
    got_a, got_b = [], []
    for x in stream:
        got_a.append(sample(x, a)[0])
        sample(x, other)
        torch.rand(3)
        got_b.append(sample(x, b)[0])
        sample(x, make_seq(seed=1, top_p=0.9))  # a fresh sequence with the same seed
    assert got_a == alone_a and got_b == alone_b


# 5. logprobs

def ref_logprobs(raw) -> np.ndarray:
    x = np.asarray(raw, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("cfg", [dict(temperature=0), dict(temperature=0.7, top_p=0.9, seed=3),
                                 dict(temperature=1.5, repetition_penalty=1.5, presence_penalty=1.0, seed=4)],
                         ids=str)
def test_logprobs_of_raw_logits(k, cfg):
    raw = rand_logits(11)
    before = raw.clone()
    token, lp = sample(raw, make_seq(prompt=[0, 1, 2], out=[int(raw.argmax())], logprobs=k, **cfg))
    assert torch.equal(raw, before)
    ref = ref_logprobs(before)
    assert lp.logprob == pytest.approx(ref[token], abs=1e-5)
    assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:k])
    np.testing.assert_allclose([v for _, v in lp.top], sorted(ref, reverse=True)[:k], atol=1e-5)


def test_logprobs_when_chosen_token_is_not_in_top_k():
    raw = rand_logits(12)
    best3 = np.argsort(-raw.numpy())[:3].tolist()
    token, lp = sample(raw, make_seq(out=best3, temperature=0, presence_penalty=100.0, logprobs=2))
    ref = ref_logprobs(raw)
    assert token == int(np.argsort(-raw.numpy())[3]) and token not in [t for t, _ in lp.top]
    assert lp.logprob == pytest.approx(ref[token], abs=1e-5)  # raw, not penalised (~-100)
    assert [t for t, _ in lp.top] == best3[:2]


def test_logprobs_off():
    assert sample(rand_logits(0), make_seq(seed=0))[1] is None
    assert sample(rand_logits(0), make_seq(temperature=0))[1] is None


# 6. validation

@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.01),
    dict(top_k=-1), dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
    dict(logprobs=-1)], ids=str)
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_edge_params_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, logprobs=0, max_tokens=1)
    SamplingParams(min_p=0.0, top_p=1e-6, repetition_penalty=1e-3, presence_penalty=-2.0, frequency_penalty=2.0)
