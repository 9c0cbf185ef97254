"""The offline API: `LLM(model=snapshot_dir).generate(prompt_token_ids, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from engine.checkpoint.loader import LoadedWeights
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.loading import load_engine
from engine.options import EngineOptions
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput, Sequence


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str = "bfloat16", max_num_seqs: int = 8,
                 max_model_len: int = 8192, page_size: int = 64, max_num_batched_tokens: int = 2048,
                 cuda_graphs: bool = True, moe_vram_budget: int | None = None, prefix_cache: bool = True,
                 pcie_expert_percent: int | None = None, **options) -> None:
        """`options`: the rest of EngineOptions' fields (engine_core.py), by name."""
        engine = EngineOptions(max_num_seqs, max_model_len, max_num_batched_tokens, page_size=page_size,
                               cuda_graphs=cuda_graphs, moe_vram_budget=moe_vram_budget, prefix_cache=prefix_cache,
                               pcie_expert_percent=pcie_expert_percent, **options)
        self._init(load_engine(model, device, dtype, engine))

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: LoadedWeights, **options) -> "LLM":
        """An engine over weights already in memory (synthetic benchmarks); device and dtype follow them."""
        llm = cls.__new__(cls)
        llm._init(EngineCore(config, weights, EngineOptions(**options)))
        return llm

    def _init(self, core: EngineCore) -> None:
        self.core, self.config, self.model = core, core.config, core.model
        self.scheduler, self.runner = core.scheduler, core.runner
        self._ids = itertools.count()

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        seqs = [self._sequence(ids, p) for ids, p in zip(prompt_token_ids, per_prompt)]
        for seq in seqs:
            self.core.add(seq)
        while self.core.has_work:
            self.core.step()
        return [RequestOutput(s.request_id, s.prompt_token_ids, s.output_token_ids, s.finish_reason,
                              s.prompt_logprobs if s.params.prompt_logprobs is not None else None) for s in seqs]

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] for every prompt position, from one prefill."""
        return self._prefill_once(token_ids)

    def layer_outputs(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The mHC streams [len, S, D] after each decoder layer (for finding where a checkpoint diverges)."""
        outputs: list[torch.Tensor] = []
        self._prefill_once(token_ids, outputs)
        return outputs

    def _prefill_once(self, token_ids: list[int], layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self.core.score_prompt(self._sequence(token_ids, SamplingParams(max_tokens=1)), layer_outputs)

    def _sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        return Sequence(str(next(self._ids)), list(token_ids), params)
