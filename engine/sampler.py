"""Next-token choice from fp32 logits: penalties, then greedy or temperature / top-k / top-p / min-p.

Each request samples with its own generator, so a seeded request gives the same tokens whatever
else shares its batch. Logprobs are taken from the model's raw distribution (before penalties and
temperature), as OpenAI reports them; a structured-output mask is already applied, as in vLLM.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.sequence import Sequence, TokenLogprobs


# (tokens so far: prompt + output, logits [V]) -> logits; applied before penalties and sampling.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
    """One token per row of logits [B, V], with one device-to-host copy for all rows that need no host
    work (greedy, or unseeded sampling: drawn on the logits' device, all such rows in one draw: a draw per
    row cost a softmax launch over the whole vocabulary each, ~1 ms a step at batch 16 on an H200); rows
    with logits processors, penalties, a seed or logprobs go through `sample`."""
    on_device = [i for i, seq in enumerate(seqs) if _samples_on_device(seq)]
    picks: dict[int, int] = {}
    if on_device:
        chosen = logits.argmax(dim=-1)
        drawn = [i for i in on_device if not seqs[i].params.greedy]
        if drawn:
            rows = torch.tensor(drawn, device=logits.device)
            probs = _probs_rows(logits[rows], [seqs[i] for i in drawn])
            chosen = chosen.index_copy(0, rows, torch.multinomial(probs, 1).squeeze(1))
        every = chosen.tolist()
        picks = {i: every[i] for i in on_device}
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
    """logits [V] -> the sampling distribution [V] of `seq`'s parameters."""
    return _probs_rows(logits.unsqueeze(0), [seq])[0]


def _probs_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [R, V] -> each row's sampling distribution under its own request's temperature, top-k, min-p
    and top-p (a row without a filter is left as is by it)."""
    params = [seq.params for seq in seqs]
    rows, vocab = logits.shape

    def column(values: list, dtype: torch.dtype = logits.dtype) -> torch.Tensor:  # one value per row, as [R, 1]
        return torch.tensor(values, dtype=dtype, device=logits.device).view(rows, 1)

    logits = logits / column([p.temperature for p in params])
    ks = [min(p.top_k, vocab) for p in params]
    if any(ks):
        kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, column([max(k - 1, 0) for k in ks], torch.long))
        logits = logits.masked_fill(column([k > 0 for k in ks], torch.bool) & (logits < kth), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p for p in params):
        floor = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        top_p = column([p.top_p for p in params])
        # keep the smallest prefix reaching top_p (rows at 1.0 keep all: rounding would cut their tail)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def verify_drafts(rows: list[torch.Tensor], seqs: list[Sequence], drafts: list[tuple[int, ...]]) -> list[list[int]]:
    """Speculative sampling of greedy drafts (`rows[i]`: request i's logits [c + 1, V], the row before its first
    draft and each draft's own row) -> each request's tokens: the accepted drafts, then one token more (drawn at
    the first rejected draft's row, or at the last draft's row when all were accepted). Greedy: a draft is
    accepted while it is the argmax. Sampling: draft j is accepted with probability p_j(draft), p_j the request's
    distribution at its row; otherwise the token is drawn from p_j without the draft, renormalized: either way
    every token follows its row's distribution exactly (the drafts' distribution is one-hot)."""
    out: list[list[int]] = []
    for row, seq, draft in zip(rows, seqs, drafts):
        if seq.params.greedy:
            picks = row.argmax(dim=-1).tolist()
            accepted = next((j for j, token in enumerate(draft) if picks[j] != token), len(draft))
            out.append(picks[:accepted + 1])
            continue
        probs = _probs_rows(row, [seq] * row.shape[0]).cpu()
        tokens: list[int] = []
        for j, token in enumerate(draft):
            if float(torch.rand((), generator=seq.generator)) < float(probs[j, token]):
                tokens.append(token)
                continue
            rest = probs[j].clone()
            rest[token] = 0.0
            tokens.append(int(torch.multinomial(rest / rest.sum(), 1, generator=seq.generator)))
            break
        else:
            tokens.append(int(torch.multinomial(probs[len(draft)], 1, generator=seq.generator)))
        out.append(tokens)
    return out
