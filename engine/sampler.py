"""Next-token choice from fp32 logits: penalties, then greedy or temperature / top-k / top-p / min-p.

Each request samples with its own generator, so a seeded request gives the same tokens whatever
else shares its batch. Logprobs are taken from the model's raw distribution (before penalties and
temperature), as OpenAI reports them; a structured-output mask is already applied, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.sequence import Sequence


# (tokens so far: prompt + output, logits [V]) -> logits; applied before penalties and sampling.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class TokenLogprobs:
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # (token id, logprob), best first


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
    """One token per row of logits [B, V], with one device-to-host copy for all rows that need no host
    work (greedy, or unseeded sampling: drawn on the logits' device); rows with logits processors,
    penalties, a seed or logprobs go through `sample`."""
    on_device = [i for i, seq in enumerate(seqs) if _samples_on_device(seq)]
    picks: dict[int, int] = {}
    if on_device:
        greedy = logits.argmax(dim=-1)
        chosen = [greedy[i] if seqs[i].params.greedy else torch.multinomial(_probs(logits[i], seqs[i]), 1)[0]
                  for i in on_device]
        picks = dict(zip(on_device, torch.stack(chosen).tolist()))
    return [(picks[i], None) if i in picks else sample(logits[i], seq) for i, seq in enumerate(seqs)]


def _samples_on_device(seq: Sequence) -> bool:
    p = seq.params
    return not p.logits_processors and not p.penalized and p.seed is None and p.logprobs is None


def sample(logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprobs | None]:
    """logits [V] fp32 for one request -> (token, logprobs if asked)."""
    params = seq.params
    raw = logits
    for processor in params.logits_processors:
        logits = processor(seq.token_ids, logits)
    if params.penalized:
        logits = apply_penalties(logits, seq)
    if params.greedy:
        token = int(logits.argmax())
    else:
        token = int(torch.multinomial(_probs(logits, seq).cpu(), 1, generator=seq.generator))
    if params.logprobs is None:
        return token, None
    return token, token_logprobs(raw.unsqueeze(0), [token], params.logprobs)[0]


def token_logprobs(raw: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Raw logits [R, V] and one token per row -> each row's logprob of its token and its top k."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=raw.device).view(-1, 1)).view(-1).tolist()
    if not k:
        return [TokenLogprobs(value, []) for value in chosen]
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    # A grammar's mask may leave fewer candidates than asked for: masked tokens (-inf) are none.
    return [TokenLogprobs(value, [(t, v) for t, v in zip(ids, values) if v != float("-inf")])
            for value, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist())]


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out = torch.tensor(seq.output_token_ids, device=logits.device)
        counts = torch.bincount(out, minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
