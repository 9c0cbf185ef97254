"""The offline API: `LLM(model=snapshot_dir).generate(prompt_token_ids, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from engine.cache import PagedLatents, RequestSlots
from engine.checkpoint.loader import LoadedWeights, load_weights
from engine.config import ModelConfig
from engine.model.glm5_next import Glm5NextModel
from engine.model_runner import ModelRunner
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str = "bfloat16", max_num_seqs: int = 8,
                 max_model_len: int = 8192, page_size: int = 64) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        config = ModelConfig.from_dir(model)
        weights = load_weights(model, config, torch.device(device), DTYPES[dtype])
        self._setup(config, weights, max_num_seqs, max_model_len, page_size)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: LoadedWeights, max_num_seqs: int = 8,
                     max_model_len: int = 8192, page_size: int = 64) -> "LLM":
        """An engine over weights already in memory (synthetic benchmarks); device and dtype follow them."""
        llm = cls.__new__(cls)
        llm._setup(config, weights, max_num_seqs, max_model_len, page_size)
        return llm

    def _setup(self, config: ModelConfig, weights: LoadedWeights, max_num_seqs: int, max_model_len: int,
               page_size: int) -> None:
        self.config = config
        self.model = Glm5NextModel(config, weights)
        dev, dtype = self.model.device, self.model.dtype
        self.max_model_len = max_model_len
        slots = RequestSlots(config, max_num_seqs, dev, dtype)
        cache = PagedLatents(config, max_num_seqs * -(-max_model_len // page_size), page_size, dev, dtype)
        self.scheduler = Scheduler(slots, cache, max_model_len)
        self.runner = ModelRunner(self.model, slots, cache)
        self._ids = itertools.count()

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        seqs = [self._sequence(ids, p) for ids, p in zip(prompt_token_ids, per_prompt)]
        for seq in seqs:
            self.scheduler.add(seq)
        while self.scheduler.has_work:
            self.step()
        return [RequestOutput(s.request_id, s.prompt_token_ids, s.output_token_ids, s.finish_reason) for s in seqs]

    def step(self) -> list[Sequence]:
        """One forward step; returns the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        logits = self.runner.run(scheduled)
        done = []
        for (seq, _), row in zip(scheduled, logits):
            seq.append(sample(row, seq.params, seq.generator), self.config.eos_token_ids)
            if seq.finished:
                self.scheduler.finish(seq)
                done.append(seq)
        return done

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] for every prompt position, from one prefill."""
        return self._prefill_once(token_ids)

    def layer_outputs(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The mHC streams [len, S, D] after each decoder layer (for finding where a checkpoint diverges)."""
        outputs: list[torch.Tensor] = []
        self._prefill_once(token_ids, outputs)
        return outputs

    def _prefill_once(self, token_ids: list[int], layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        if self.scheduler.has_work:
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = self._sequence(token_ids, SamplingParams(max_tokens=1))
        self.scheduler.add(seq)
        scheduled = self.scheduler.schedule()
        try:
            return self.runner.run(scheduled, all_rows=True, layer_outputs=layer_outputs)
        finally:
            self.scheduler.finish(seq)

    def _sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        return Sequence(next(self._ids), list(token_ids), params, generator=generator)
