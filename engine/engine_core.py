"""The engine loop's body: scheduler + model runner + sampler. One `step()` = one forward pass.

Single-threaded by design; the offline `LLM` drives it directly and `AsyncEngine` drives it from
its own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.cache.prefix_cache import PrefixCache, PrefixCacheStats
from engine.checkpoint.loader import LoadedWeights, checkpoint_sizes, load_weights
from engine.kernels.dispatch import fast_kernels_enabled
from engine.kernels.kda.fla_prefill import start_kda_warm_up
from engine.kernels.kda.fla_tuning import use_tuned_configs
from engine.kernels.kernel_manifest import COMPILES, model_shapes, start_preload
from engine.kernels.token_variants import covering_lengths
from engine.config import ModelConfig
from engine.checkpoint.availability import ExpertAvailability
from engine.experts import default_executor, executor_class
from engine.experts.pending import PendingExperts
from engine.experts.hybrid import HybridExperts, OffloadStats
from engine.offload.miss_split import choose_split
from engine.model.glm5_next import Glm5NextModel
from engine.memory_plan import MemoryPlan, build_caches, plan_memory
from engine.model_runner import ModelRunner
from engine.options import EngineOptions
from engine.sampler import TokenLogprobs, sample_batch
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import Sequence
from engine.structured import GrammarCompiler, RequestConstraint
from engine.structured.masks import GrammarMasks

log = logging.getLogger("glmflash.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to the slot count, and the slot count itself: a step pads to the next size."""
    sizes = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    return tuple(sorted(sizes | {max_num_seqs}))


class EngineCore:
    def __init__(self, config: ModelConfig, weights: LoadedWeights, options: EngineOptions = EngineOptions(),
                 tokenizer: Tokenizer | None = None, experts: ExpertAvailability | None = None,
                 plan: MemoryPlan | None = None) -> None:
        """`tokenizer` (the snapshot's) is what grammars are compiled against; without it requests cannot
        ask for structured output. `experts`: the routed experts are still being filled in (early
        readiness); steps load the ones they need first, until the fill is complete. `plan`: the memory plan
        the weights were loaded under (none: the weights were built in memory, and it is made now)."""
        self.config, self.options = config, options
        embed = weights["embed_tokens.weight"]
        dev, dtype = embed.device, embed.dtype
        if dev.type == "cuda" and fast_kernels_enabled():
            self._wait_for_warm_up(options, dev, dtype)
        self.plan = plan or plan_memory(config, options, dev, dtype)
        self.slots, self.cache = build_caches(config, options, self.plan, dev, dtype)
        self.prefix = self._prefix_cache(config, self.plan) if options.prefix_cache else None
        self.offload = self._hybrid_experts(config, weights, options, self.plan)
        executor = self.offload or default_executor(weights, config.moe_layers, config.swiglu_limit, dev)
        self.pending = PendingExperts(executor, experts) if experts is not None and not experts.complete else None
        self.model = Glm5NextModel(config, weights, self.pending or executor)
        limits = SchedulerLimits(options.max_model_len, max(options.max_num_batched_tokens, options.max_num_seqs),
                                 options.max_waiting)
        self.scheduler = Scheduler(self.slots, self.cache, limits, self.prefix)
        self.runner = ModelRunner(self.model, self.slots, self.cache, self.cache.pages_for(options.max_model_len))
        self._by_id: dict[str, Sequence] = {}
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids) if tokenizer else None
        self.masks = GrammarMasks(config.vocab_size, options.max_num_seqs, dev)
        self.step_times = StepTimes()
        if dev.type == "cuda" and fast_kernels_enabled():
            self._warm_up(options)
        self._report_decode_rate()
        if dev.type == "cuda" and fast_kernels_enabled() and self.pending is None:
            self.warm_up_prefills()
        if dev.type == "cuda":  # what the start compiled; from here on each compile is logged on its own
            log.info("event=kernel_compiles %s", COMPILES.started())

    def _wait_for_warm_up(self, options: EngineOptions, device: torch.device, dtype: torch.dtype) -> None:
        """Before the engine's first kernel: the kernels an earlier start compiled are compiled again (or read
        from Triton's cache) and fla's prefill kernels tuned, both started with the reads; neither then
        competes with the engine's own GPU work (placement timings, graph capture)."""
        start = time.perf_counter()
        self.start_warm_up(self.config, device, dtype, options.kernels_file, options.precompile_processes).result()
        log.info("event=warm_up_wait waited_s=%.2f", time.perf_counter() - start)

    def _warm_up(self, options: EngineOptions) -> None:
        """Capture the decode graphs now, not inside the first requests."""
        if options.cuda_graphs and self.pending is not None:
            log.info("event=decode_graphs deferred=experts_loading")  # missing experts are loaded inside steps
        elif options.cuda_graphs and self._graphs_allowed():
            self._capture_graphs()

    def warm_up_prefills(self) -> None:
        """Prefills of random tokens, one step each, so the compiles a step's token count can call for happen in
        the start, not in the first requests: the longest step, which runs every kernel launcher once, then one
        length per combination of builds it has not taken (engine/kernels/token_variants.py). Outside the prefix
        cache (which would hold back a prompt's last token, and keep random prompts); the engine is idle after,
        its slots free."""
        if self.has_work:
            raise RuntimeError("the prefill warm-up needs an idle engine")
        start = time.perf_counter()
        longest = min(self.options.max_num_batched_tokens, self.options.max_model_len - 1)
        g = torch.Generator().manual_seed(0)
        prefix, self.scheduler.prefix = self.scheduler.prefix, None
        try:
            lengths = [longest]
            for index, length in enumerate(lengths):  # the others join once the longest has run every launcher
                prompt = torch.randint(self.config.vocab_size, (length,), generator=g).tolist()
                self.add(Sequence(f"warm-up-prefill-{index}", prompt, SamplingParams(max_tokens=1)))
                while self.has_work:
                    self.step()
                if index == 0:
                    lengths += covering_lengths(longest, done=lengths)
        finally:
            self.scheduler.prefix = prefix
        log.info("event=prefill_warm_up lengths=%s seconds=%.1f", ",".join(map(str, lengths)),
                 time.perf_counter() - start)

    def _report_decode_rate(self, steps: int = 8) -> None:
        """The boot log's expected tok/s: batch-1 decode steps timed as requests run them, with a GPU or with
        experts on the host (where placement decides the rate); not while experts are still loading."""
        if self.pending is not None or (self.offload is None and self.model.device.type != "cuda"):
            return
        step = self.runner.time_decode(steps, self.config.vocab_size)
        log.info("event=decode_probe batch=1 step_ms=%.2f expected_tok_s=%.1f graphs=%s", step * 1e3, 1 / step,
                 "yes" if self.runner.graphs is not None else "no")

    @staticmethod
    def start_warm_up(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                      kernels_file: Path | None = None, precompile_processes: int | None = None) -> Future:
        """Start the warm-up that needs only the config in the background: the preload of the Triton kernels
        an earlier start recorded in `kernels_file` (this one records its own there) and fla's KDA-prefill
        autotuning, after it. A loader calls it before reading the weights, the engine waits on it before its
        first kernel; a second call returns the same work. On the CPU (or with the fast kernels off) there is
        nothing to warm: a finished future."""
        if device.type == "cuda" and fast_kernels_enabled():
            if device.index is None:  # one warm-up for "cuda" (a loader's) and "cuda:0" (the weights')
                device = torch.device("cuda", torch.cuda.current_device())
            use_tuned_configs(torch.cuda.get_device_capability(device))  # before the preload imports fla
            preload = start_preload(kernels_file, device, dtype, model_shapes(config), precompile_processes)
            return start_kda_warm_up(device, config.linear_num_heads, config.linear_head_dim, dtype, after=preload)
        done: Future = Future()
        done.set_result(None)
        return done

    def _graphs_allowed(self) -> bool:
        """Host experts in a format the compiled CPU kernels do not take run through a synchronizing path."""
        if self.offload is not None and not self.offload.graph_safe:
            log.info("event=decode_graphs skipped=host_experts_uncompiled")
            return False
        return True

    def _capture_graphs(self) -> None:
        sizes = graph_sizes(self.options.max_num_seqs)
        seconds = self.runner.capture_graphs(sizes, None if self.offload is None else self.offload.use_rows)
        log.info("event=decode_graphs sizes=%s capture_s=%.2f", ",".join(map(str, sizes)), seconds)

    def _experts_complete(self) -> None:
        """Between steps, once the fill is done: the plain executor from now on, and the decode graphs that
        were deferred (CUDA)."""
        self.model.use_experts(self.pending.inner)
        log.info("event=experts_resident executor=%s", type(self.pending.inner).__name__)
        self.pending = None
        if (self.model.device.type == "cuda" and fast_kernels_enabled() and self.options.cuda_graphs
                and self._graphs_allowed()):
            self._capture_graphs()
        self._report_decode_rate()

    def _prefix_cache(self, config: ModelConfig, plan: MemoryPlan) -> PrefixCache:
        device, host = plan.prefix_device, plan.prefix_host
        log.info("event=prefix_cache device_snapshots=%d device_pages=%d host_snapshots=%d host_pages=%d",
                 device.snapshots, device.pages, host.snapshots, host.pages)
        return PrefixCache(config, self.slots, self.cache, device.snapshots, host)

    @staticmethod
    def _hybrid_experts(config: ModelConfig, weights: LoadedWeights, options: EngineOptions,
                        plan: MemoryPlan) -> HybridExperts | None:
        """Experts split between device slots and the host bank when the plan gives them a budget."""
        if plan.expert_budget is None:
            return None
        device = weights["norm.weight"].device
        hybrid = HybridExperts.from_weights(weights, config.moe_layers, config.swiglu_limit, device, plan.expert_budget,
                                            executor_class(device), options.cpu_expert_threads,
                                            options.cpu_expert_pin)
        hybrid.split_misses(*choose_split(hybrid, config.num_experts_per_tok, options.pcie_expert_percent,
                                          options.miss_split_file))
        slots = len(hybrid.resident[config.moe_layers[0]])
        gib_per_slot = hybrid.expert_bytes * len(config.moe_layers) / 2 ** 30  # one expert in every MoE layer
        log.info("event=expert_placement device_slots_per_layer=%d of=%d device_gib=%.2f host_gib=%.2f",
                 slots, hybrid.num_experts, gib_per_slot * slots, gib_per_slot * (hybrid.num_experts - slots))
        return hybrid

    @classmethod
    def from_snapshot(cls, model: str | Path, device: str = "cpu", dtype: str = "bfloat16",
                      options: EngineOptions = EngineOptions()) -> "EngineCore":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        config = ModelConfig.from_dir(model)
        device = torch.device(device)
        cls.start_warm_up(config, device, DTYPES[dtype], options.kernels_file, options.precompile_processes)
        plan = plan_memory(config, options, device, DTYPES[dtype], checkpoint_sizes(Path(model), config))
        weights = load_weights(model, config, device, DTYPES[dtype], plan.expert_slots)
        tokenizer_file = Path(model) / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
        return cls(config, weights, options, tokenizer, plan=plan)

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

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
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

    def count_routing(self, prompts: list[list[int]]) -> int:
        """Prefill each prompt once (a calibration set) so hybrid placement starts from its routing: the
        experts it routes to most move into device slots now, or over the first steps while swaps are
        held. -> swaps made now."""
        if self.offload is None or not prompts:
            return 0
        if self.has_work:
            raise RuntimeError("routing calibration needs an idle engine")
        keep = self.options.max_model_len - 1
        for index, ids in enumerate(p for p in prompts if p):
            self.add(Sequence(f"routing-calibration-{index}", ids[:keep], SamplingParams(max_tokens=1)))
        while self.has_work:
            self.step()
        self.offload.settle_all = True
        return self.offload.rebalance(0)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        if self.pending is not None and self.pending.availability.complete:
            self._experts_complete()
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        for seq, _ in scheduled:
            seq.started = start if seq.started is None else seq.started
        done = [seq for seq, new in scheduled if seq.cached + new == seq.num_tokens]  # the logits rows, in order
        masks = self.masks.start(done)  # filled on the CPU while the forward runs
        saves = self.prefix.step_saves(self.cache.latents.device) if self.prefix else None
        if self.offload is not None:  # here, where no step is in flight: its later layers would read a new share
            self.offload.follow_cpu_rate()
        logits = self.runner.run(scheduled, saves=saves)
        self.scheduler.commit(scheduled)
        if self.offload is not None and self.pending is None:  # swaps would move experts the fill has yet to write
            self.offload.rebalance(self.options.max_expert_swaps)
        if masks is not None:
            self.masks.apply(logits, masks)
        outputs = []
        sampled = sample_batch(logits, done)
        end = time.perf_counter()
        self.step_times = self.step_times.plus(any(new > 1 for _, new in scheduled), end - start)
        for seq, (token, logprobs) in zip(done, sampled):
            seq.append(token, self.config.eos_token_ids)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            first = len(seq.output_token_ids) == 1
            outputs.append(StepOutput(seq.request_id, token, logprobs, seq.finish_reason, seq.cached_prompt_tokens,
                                      seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
                                      RequestPhases(seq.started - seq.arrived, end - seq.started) if first else None))
            if seq.finished:
                self.scheduler.finish(seq)
                del self._by_id[seq.request_id]
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.slots.num_slots - self.slots.free_count, self.slots.num_slots,
                           self.cache.num_pages - self.cache.free_pages, self.cache.num_pages,
                           None if self.offload is None else self.offload.stats,
                           None if self.prefix is None else self.prefix.stats(), self.step_times)
