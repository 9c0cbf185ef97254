"""Drafts from the checkpoint's MTP layer, kept in step with the main model, and (with `speculative_tokens` k)
verified in the next step: speculative decoding.

After every step, before the requests are updated (`follow`), the MTP layer runs over the step's rows (the main
model's collapsed hidden at each position, the token after it: a prompt token, or one just sampled), so its cache
(the caches' last DSA index) holds every position the main model computed when a snapshot, finish or restore reads
it. Then (`draft`) each request that sampled and goes on gets its drafts from the row before its last token: the
first from that row, each further one from the MTP layer run again on its own output and the draft before
(a chain of one-token steps at the positions after; its open indexer pool is put back afterwards, and the latents
it wrote there are rewritten before anything reads them). Where the main model's step replays a CUDA graph, the
MTP layer's follow and chain steps replay theirs (`engine.mtp_graphs`), each row's draft taken inside the graph.

With k > 0, a request's next step runs its tokens and then its drafts as one span (the verify): the row of its last
known token gives the next token as without drafts, and each accepted draft's row one more
(`engine.sampler.verify_drafts`: the argmax for greedy requests, rejection sampling otherwise), so a step yields
up to k + 1 tokens for about the price of one step's weight reads. Where a draft is rejected, the positions after
it have left their traces in the request's recurrent, short-conv and open-pool state: the scheduler restores the
state copied before the step (`restore`), and the request's tokens run again with the new ones in its next step,
which verifies new drafts made from the rows that held: fewer, so that every step keeps k + 1 rows a request, the
shape the verify graphs were captured at (`engine.decode_graphs`). Greedy output is the same token for token as without
drafts; sampled output follows the same distribution.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.cache.state_rows import StateRows
from engine.config import ModelConfig
from engine.decode_graphs import DecodeGraphs
from engine.draft_length import DraftLength
from engine.model.batch import ForwardBatch
from engine.model.mtp import MtpLayer
from engine.model_runner import ModelRunner
from engine.mtp_graphs import MtpGraphs
from engine.sequence import Sequence
from engine.step_plan import StepPlan, StepResult


@dataclass
class DraftStats:
    proposed: int = 0  # first drafts whose position the main model has since sampled
    accepted: int = 0  # of those, drafts equal to the sampled token
    verify_steps: int = 0  # request-steps that verified drafts (speculative)
    verified: int = 0  # draft tokens verified
    verified_accepted: int = 0  # of those, accepted: each gave one more token in its step
    draft_length: int = 0  # drafts a request gets for its next step (speculative: chosen from measured costs)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step gave a request, on average (1 + its accepted drafts)."""
        return 1 + self.verified_accepted / self.verify_steps if self.verify_steps else None


def verifiable(seq: Sequence) -> bool:
    """A request whose next token depends on its (masked) logits row alone (greedy, or temperature / top-k /
    top-p / min-p sampling, a grammar or not): its drafts can be verified from the rows
    (`engine.sampler.verify_drafts`)."""
    p = seq.params
    return not p.logits_processors and not p.penalized and p.logprobs is None and p.prompt_logprobs is None


def _accepted(seq: Sequence, first: int, drafts: tuple[int, ...]) -> int:
    """Drafts equal to the tokens the request took from position `first` on (a rejected draft never is)."""
    taken = seq.token_ids[first:first + len(drafts)]
    return next((j for j, (a, b) in enumerate(zip(taken, drafts)) if a != b), len(taken))


class MtpDrafter:
    def __init__(self, config: ModelConfig, layer: MtpLayer, runner: ModelRunner, speculative_tokens: int,
                 measured_length: bool = True) -> None:
        """`config`: the caches' (the MTP layer's DSA included); `speculative_tokens`: the most drafts verified a
        step (0: one draft a request, only counted); `measured_length`: each step's number chosen from measured
        costs (`engine.draft_length`), else always the most."""
        self.layer, self.runner, self.k = layer, runner, speculative_tokens
        self.length = DraftLength(speculative_tokens) if speculative_tokens and measured_length else None
        self.k_now = speculative_tokens  # drafts a request gets this step
        self._decoding = False  # whether every request of the step under way decodes
        self.slots, self.cache = runner.slots, runner.cache
        self.index = layer.mixer.cache_index
        self.stats = DraftStats()
        self._sources: dict[Sequence, tuple[int, int]] = {}  # request -> (its draft's row, its first new position)
        self._z: torch.Tensor | None = None  # the MTP layer's output over the step's rows, `follow` to `draft`
        self._drafted: torch.Tensor | None = None  # and each row's draft, where a graph made them
        self.graphs: MtpGraphs | None = None  # captured with the main model's (`capture_graphs`)
        if speculative_tokens:  # each verifying slot's state from before its step, the MTP layer's included
            cache = self.cache
            self.saved = StateRows(config, self.slots.num_slots + 1, cache.page_size, cache.latents.device,
                                   cache.dtype, fp8=cache.fp8)

    def _drafts_wanted(self, seq: Sequence) -> int:
        """Drafts to make for `seq`: k, fewer near max_tokens (a step yields at most drafts + 1 tokens), one
        when they are only counted. After a rejection its tokens since run again first: the step keeps k + 1
        rows a request (the verify graphs' shape) with fewer drafts."""
        if not self.k:
            return 1
        left = seq.params.max_tokens - len(seq.output_token_ids) - 1
        return max(0, min(self.k_now + 1 - seq.num_to_compute, left))

    def with_drafts(self, plan: StepPlan) -> StepPlan:
        """The plan with its decoding requests' drafts to verify; their states copied first."""
        if not self.k:
            return plan
        self._decoding = all(span.samples and span.seq.num_computed >= len(span.seq.prompt_token_ids)
                             for span in plan.spans)
        saving = plan.snapshot_saves.requests if plan.snapshot_saves is not None else ()
        drafts = {span.seq: span.seq.draft_tokens[:self._drafts_wanted(span.seq)] for span in plan.spans
                  if span.samples and span.seq.draft_tokens and span.seq not in saving and verifiable(span.seq)
                  and span.seq.num_computed >= len(span.seq.prompt_token_ids)}
        drafts = {seq: d for seq, d in drafts.items() if d}
        for seq in drafts:
            self.saved.save(seq.slot, self.slots, seq.slot, self.cache, None)
        return dataclasses.replace(plan, drafts=drafts) if drafts else plan

    def restore(self, seq: Sequence) -> None:
        """`seq`'s state back to before its verify step (a draft was rejected, or it finished inside its run)."""
        self.saved.load(seq.slot, self.slots, seq.slot, self.cache, None)

    def follow(self, plan: StepPlan, result: StepResult, sampled: list[int],
               after_drafts: dict[Sequence, list[int]]) -> None:
        """Before the requests are updated: the MTP layer over the step's rows, each with the token after it (known,
        or new this step: `sampled` for each request of `plan.to_sample`, then its verified drafts' tokens), so its
        state holds every position the main model computed before any snapshot, finish or restore reads it."""
        main = result.batch
        new = {seq: [token] + after_drafts.get(seq, []) for seq, token in zip(plan.to_sample, sampled)}
        tokens: list[int] = []
        self._sources = {}
        parts = iter(main.spans)
        for span in plan.spans:
            seq = span.seq
            split = plan.snapshot_saves is not None and seq in plan.snapshot_saves.requests
            own = [next(parts)] + ([next(parts)] if split else [])
            start, rows = own[0].num_computed, sum(part.new for part in own)
            known = seq.token_ids + new.get(seq, [])
            after = known[start + 1:start + rows + 1]
            tokens.extend(after + [0] * (rows - len(after)))  # none after the tokens taken (rows of undone drafts)
            if seq in new:
                last = len(known) - 2  # the position whose next token is the last one taken
                part = next(p for p in own if p.num_computed <= last < p.total)
                self._sources[seq] = (part.offset + last - part.num_computed, start + span.num_new)
        batch = ForwardBatch(torch.tensor(tokens, dtype=torch.long, device=result.hidden.device), main.spans,
                             main.decode, main.one_token, main.snapshot_saves)
        self._z, self._drafted = self._layer(result.hidden, batch)

    def capture_graphs(self, graphs: DecodeGraphs, before_replay: Callable[[int], None] | None = None) -> float:
        """Graphs of the MTP layer at the main model's graphs' shapes (the follow of a decode or verify step, and
        the chain's one-token steps); returns the seconds it took."""
        self.graphs = MtpGraphs(self.layer, self.slots, self.cache, self.runner.max_pages, graphs.shapes,
                                graphs.pool, before_replay)
        return self.graphs.capture_s

    def _layer(self, hidden: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MTP layer over the batch's rows -> its output z, and each row's greedy draft where a graph ran it
        (a static step of a captured shape), else None (`_drafts` takes them from the rows wanted)."""
        meta = batch.decode
        if meta is not None and self.graphs is not None and self.graphs.holds(len(meta.request_slots),
                                                                                meta.per_request):
            return self.graphs.run(hidden, batch.token_ids, meta)
        return self.layer(hidden, batch, self.slots, self.cache), None

    def _drafts(self, z: torch.Tensor, drafted: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy drafts of z's rows (`rows`, else every one): the graph's where it made them."""
        if drafted is not None:
            return drafted if rows is None else drafted[rows]
        return self.layer.logits(z if rows is None else z[rows]).argmax(dim=-1)

    def draft(self, plan: StepPlan) -> None:
        """After the requests were updated (tokens appended, drafts verified, finishes decided): score the drafts
        they had and draft anew for those that sampled and go on, from the row before their last token."""
        going: list[tuple[Sequence, int]] = []
        for seq, (row, first) in self._sources.items():
            self._score(seq, first, plan.drafts.get(seq))
            seq.draft_tokens = ()
            if not seq.finished:
                going.append((seq, row))
        if self.length is not None:
            self.k_now = self.length.choose(len(going))
        self.stats.draft_length = self.k_now if self.k else 1
        firsts = [(seq, row) for seq, row in going if self._drafts_wanted(seq) > 0]
        if not firsts:
            self._z = None
            return
        rows = torch.tensor([row for _, row in firsts], dtype=torch.long, device=self._z.device)
        z, first = self._z[rows], self._drafts(self._z, self._drafted, rows)
        self._z = self._drafted = None
        for (seq, _), made in zip(firsts, self._chain([seq for seq, _ in firsts], z, first)):
            seq.draft_tokens = tuple(made)

    def _score(self, seq: Sequence, first: int, verified: tuple[int, ...] | None) -> None:
        """Count `seq`'s first draft (right or not: the token now at position `first`) and its verified ones."""
        if seq.draft_tokens:
            self.stats.proposed += 1
            self.stats.accepted += seq.token_ids[first] == seq.draft_tokens[0]
        if verified is not None:
            accepted = _accepted(seq, first, verified)
            self.stats.verify_steps += 1
            self.stats.verified += len(verified)
            self.stats.verified_accepted += accepted
            if self.length is not None:
                self.length.verdict(len(verified), accepted)

    def timed(self, plan: StepPlan, seconds: float) -> None:
        """A step's wall time, drafting for the next included, for the draft length's choice: steps where every
        request decodes and runs the same number of rows (1 + k: its token and drafts, or after a rejection its
        tokens again and fewer drafts), timed as a step of k drafts."""
        rows = {span.num_new + len(plan.drafts.get(span.seq, ())) for span in plan.spans}
        if self.length is None or not self._decoding or len(rows) > 1:
            return
        self.length.timed(len(plan.to_sample), rows.pop() - 1, seconds)

    def _chain(self, seqs: list[Sequence], z: torch.Tensor, first: torch.Tensor) -> list[list[int]]:
        """Each request's drafts: `first` [n], then 2.. from the MTP layer on its own output z and the draft before,
        one position on; on the device until one copy of them all to the host."""
        wanted = [self._drafts_wanted(seq) for seq in seqs]
        drafts = torch.zeros(len(seqs), max(wanted), dtype=torch.long, device=z.device)
        drafts[:, 0] = first
        for j in range(1, max(wanted)):
            rows = [i for i, w in enumerate(wanted) if w > j]
            chain = [seqs[i] for i in rows]
            meta = self.runner.decode_meta([(seq, seq.num_tokens - 2 + j) for seq in chain])
            index = torch.tensor(rows, device=z.device)
            batch = ForwardBatch(drafts[index, j - 1], [], meta)
            with self._pools_kept([seq.slot for seq in chain]):
                out, drafted = self._layer(z[index], batch)
            z = z.index_copy(0, index, out)
            drafts[index, j] = self._drafts(out, drafted)
        return [made[:w] for made, w in zip(drafts.tolist(), wanted)]

    @contextmanager
    def _pools_kept(self, slots: list[int]) -> Iterator[None]:
        """The MTP layer's open indexer pool of these slots as it was before the block: positions the chain runs
        are drafts ahead of the tokens taken, not the requests'."""
        if not slots:
            yield
            return
        ids = torch.tensor(slots, device=self.slots.open_pool.device)
        kept = self.slots.open_pool[self.index, ids].clone()
        yield
        self.slots.open_pool[self.index, ids] = kept
