"""The engine loop's body: scheduler + model runner + sampler. One `step()` = one forward pass.

Single-threaded by design; the offline `LLM` drives it directly and `AsyncEngine` drives it from
its own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from engine.build import build_parts
from engine.cache.prefix_cache import PrefixCacheStats
from engine.checkpoint.availability import ExpertAvailability
from engine.checkpoint.loader import LoadedWeights
from engine.config import ModelConfig
from engine.experts.hybrid import OffloadStats
from engine.memory_plan import MemoryPlan
from engine.mtp_drafter import DraftStats
from engine.options import EngineOptions
from engine.sampler import sample_batch, verify_drafts
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs
from engine.step_plan import StepPlan
from engine.structured import GrammarCompiler, RequestConstraint
from engine.structured.masks import GrammarMasks
from engine.warm_up import after_expert_fill, warm_up

log = logging.getLogger("glmflash.engine")

@dataclass
class StepOutput:
    """One new token of one request; `finish_reason` is set on its last token."""

    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens the request restored from the prefix cache
    prompt_logprobs: list[TokenLogprobs] | None = None  # on a request's first token, when its params ask
    phases: RequestPhases | None = None  # on a request's first token


@dataclass(frozen=True)
class RequestPhases:
    """Where a request's time to first token went inside the engine: queued (taken, not yet in a step: waiting
    for a slot, the step already running, or a prefix another request is computing) and prefilling (from its
    first step to the end of the step that sampled its first token)."""

    queued_s: float
    prefill_s: float


@dataclass(frozen=True)
class StepTimes:
    """Steps run since start and their wall time, by kind: decode (every request runs one token, a CUDA
    graph where captured) and prefill (some request runs a prompt chunk)."""

    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0

    def plus(self, prefill: bool, seconds: float) -> "StepTimes":
        if prefill:
            return dataclasses.replace(self, prefill_steps=self.prefill_steps + 1,
                                       prefill_seconds=self.prefill_seconds + seconds)
        return dataclasses.replace(self, decode_steps=self.decode_steps + 1,
                                   decode_seconds=self.decode_seconds + seconds)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    slots_used: int
    slots_total: int
    pages_used: int
    pages_total: int
    offload: OffloadStats | None = None  # hybrid expert placement's totals (None: every expert resident)
    prefix: PrefixCacheStats | None = None  # prefix cache totals (None: no prefix cache)
    steps: StepTimes = StepTimes()
    drafts: DraftStats | None = None  # the MTP layer's drafts, proposed and right (None: drafts off)


class EngineCore:
    """The engine's loop body: add / abort / step / stats. Its parts are built in engine/build.py, its warm-up
    runs in engine/warm_up.py, models are loaded from files in engine/loading.py."""

    def __init__(self, config: ModelConfig, weights: LoadedWeights, options: EngineOptions = EngineOptions(),
                 tokenizer: Tokenizer | None = None, experts: ExpertAvailability | None = None,
                 plan: MemoryPlan | None = None) -> None:
        """`tokenizer` (the snapshot's) is what grammars are compiled against; without it requests cannot
        ask for structured output. `experts`: the routed experts are still being filled in (early
        readiness); steps load the ones they need first, until the fill is complete. `plan`: the memory plan
        the weights were loaded under (none: the weights were built in memory, and it is made now)."""
        parts = build_parts(config, weights, options, plan, experts)
        # the plan's prefill chunk where the options left it open: the warm-up compiles for the longest step
        self.config = config
        self.options = dataclasses.replace(options, max_prefill_tokens=parts.plan.prefill_tokens)
        self.plan, self.slots, self.cache, self.prefix = parts.plan, parts.slots, parts.cache, parts.prefix
        self.offload, self.expert_fill, self.model = parts.offload, parts.expert_fill, parts.model
        self.scheduler, self.runner, self.drafter = parts.scheduler, parts.runner, parts.drafter
        self._by_id: dict[str, Sequence] = {}
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids) if tokenizer else None
        self.masks = GrammarMasks(config.vocab_size, options.max_num_seqs * (options.speculative_tokens + 1),
                                  self.model.device)
        self.step_times = StepTimes()
        warm_up(self)

    def constraint(self, request_id: str, params: SamplingParams) -> RequestConstraint | None:
        """The token constraint `params` ask for, compiled (GrammarError if the grammar does not compile;
        may take long for a huge grammar, so callers that serve others compile off the engine thread)."""
        if params.grammar is None and (params.reasoning is None or params.reasoning.budget is None):
            return None
        if params.grammar is not None and self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer, and this engine has none")
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.config.eos_token_ids))
        return RequestConstraint(request_id, self.config.vocab_size, matcher, params.reasoning, stops)

    @property
    def accepts_images(self) -> bool:
        """Whether the model has a vision tower (a checkpoint without one serves text)."""
        return self.runner.images is not None

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.images and not self.accepts_images:
            raise ValueError("this model has no vision tower: it answers text only")
        if seq.constraint is None:
            seq.constraint = self.constraint(seq.request_id, seq.params)
        seq.arrived = time.perf_counter()
        self.scheduler.add(seq)
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its slot and pages are free for the next step."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.finish(seq)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_waiting(self) -> int:
        return self.scheduler.limits.max_waiting

    def running_ids(self) -> list[str]:
        return self.scheduler.running_ids()

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError if a request of this size can never run here (the context limit)."""
        self.scheduler.check(prompt_len, max_tokens)

    def teacher_forced_step(self, spans: StepPlan | list[tuple[Sequence, int]], all_rows: bool = False
                            ) -> torch.Tensor:
        """Run a step of these (request, tokens) spans, or a scheduler's plan, without sampling: the logits (rows
        as `ModelRunner.run` gives them), the requests' computed tokens advanced and nothing appended. Tests and
        benchmarks feed the tokens themselves."""
        plan = spans if isinstance(spans, StepPlan) else StepPlan.of(spans, all_rows=all_rows)
        result = self.runner.run(plan)
        self.scheduler.advance(plan, result)
        return result.logits

    def score_prompt(self, seq: Sequence, layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits of every position of `seq`'s prompt, from one prefill outside the queue (an idle engine),
        and with `layer_outputs` the mHC streams after each layer; the request leaves at once."""
        if self.has_work:
            raise RuntimeError("prompt_logits needs an idle engine")
        self.scheduler.admit_now(seq)
        try:
            return self.runner.run(StepPlan.of([(seq, seq.num_tokens)], all_rows=True), layer_outputs).logits
        finally:
            self.scheduler.finish(seq)

    def step(self) -> list[StepOutput]:
        """One step: plan (scheduler), compute (runner), sample, and update the requests (scheduler)."""
        if self.expert_fill is not None and self.expert_fill.availability.complete:
            self._drop_expert_fill()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        if self.drafter is not None:
            plan = self.drafter.with_drafts(plan)
        masks = self.masks.start(list(plan.to_sample), plan.drafts_in_order)  # on the CPU while the forward runs
        if self.offload is not None:  # here, where no step is in flight: its later layers would read a new share
            self.offload.follow_cpu_rate()
        result = self.runner.run(plan, with_hidden=self.drafter is not None)
        if self.offload is not None and self.expert_fill is None:  # swaps would move experts the fill has yet to write
            self.offload.rebalance(self.options.max_expert_swaps)
        sampled, after_drafts = self._sample(plan, result.logits, masks)
        end = time.perf_counter()
        self.step_times = self.step_times.plus(plan.has_prefill, end - plan.started)
        before = {seq: len(seq.output_token_ids) for seq in plan.drafts}
        restore = self.drafter.restore if self.drafter is not None else None
        if self.drafter is not None:
            self.drafter.follow(plan, result, [token for token, _ in sampled], after_drafts)
        for seq in self.scheduler.update(plan, result, sampled, self.config.eos_token_ids, after_drafts, restore):
            del self._by_id[seq.request_id]
        if self.drafter is not None:
            self.drafter.draft(plan)
            self.drafter.timed(plan, time.perf_counter() - plan.started)
        outputs = []
        for seq, (token, logprobs) in zip(plan.to_sample, sampled):
            first = len(seq.output_token_ids) == 1
            accepted = seq.output_token_ids[before[seq] + 1:] if seq in before else []  # a verify's further tokens
            outputs.append(StepOutput(seq.request_id, token, logprobs, None if accepted else seq.finish_reason,
                                      seq.cached_prompt_tokens,
                                      seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
                                      RequestPhases(seq.started - seq.arrived, end - seq.started) if first else None))
            outputs.extend(StepOutput(seq.request_id, extra, None, seq.finish_reason, seq.cached_prompt_tokens, None,
                                      None) for extra in accepted)
        return outputs

    def _sample(self, plan: StepPlan, logits: torch.Tensor, masks) -> tuple[list[tuple[int, TokenLogprobs | None]],
                                                                         dict[Sequence, list[int]]]:
        """A token for each request that samples (its row of `logits`, masked where it is constrained) and, for
        the drafted ones (their draft rows follow), the verdict on their drafts: the tokens after the first."""
        rows = len(plan.to_sample)
        if masks is not None:
            self.masks.apply(logits, masks)
        drafted = plan.drafts_in_order
        if not drafted:
            return sample_batch(logits[:rows], list(plan.to_sample)), {}
        others = [i for i, seq in enumerate(plan.to_sample) if seq not in plan.drafts]
        row_of = {seq: i for i, seq in enumerate(plan.to_sample)}
        verified, first = [], rows
        for seq, drafts in drafted:  # each request's row before its drafts, then its draft rows
            verified.append(torch.cat([logits[row_of[seq]:row_of[seq] + 1], logits[first:first + len(drafts)]]))
            first += len(drafts)
        verdicts = verify_drafts(verified, [seq for seq, _ in drafted], [drafts for _, drafts in drafted])
        sampled: list[tuple[int, TokenLogprobs | None]] = [(0, None)] * rows
        for i, pick in zip(others, sample_batch(logits[others], [plan.to_sample[i] for i in others])):
            sampled[i] = pick
        for (seq, _), tokens in zip(drafted, verdicts):
            sampled[row_of[seq]] = (tokens[0], None)
        return sampled, {seq: tokens[1:] for (seq, _), tokens in zip(drafted, verdicts)}

    def _drop_expert_fill(self) -> None:
        """Between steps, once the fill is done: the plain executor from now on."""
        self.model.use_experts(self.expert_fill.inner)
        if self.offload is not None:
            self.offload.prefetch_banks = True
        log.info("event=experts_resident executor=%s", type(self.expert_fill.inner).__name__)
        self.expert_fill = None
        after_expert_fill(self)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), self.scheduler.num_waiting,
                           self.slots.num_slots - self.slots.free_count, self.slots.num_slots,
                           self.cache.num_pages - self.cache.free_pages, self.cache.num_pages,
                           None if self.offload is None else self.offload.stats,
                           None if self.prefix is None else self.prefix.stats(), self.step_times,
                           None if self.drafter is None else dataclasses.replace(self.drafter.stats))
