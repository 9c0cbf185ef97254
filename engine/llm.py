"""The offline API: `LLM(model=snapshot_dir).generate(prompts, SamplingParams(...))`.

A prompt is a list of token ids, or (with images, as vLLM takes them) a dict
`{"prompt_token_ids": [...], "multi_modal_data": {"image": [image, ...]}}` whose images are PIL images, encoded
bytes or `ProcessedImage`s, each at one image token of the prompt (or its full run of image tokens).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Union

import torch
from PIL import Image

from engine.checkpoint.loader import LoadedWeights
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.loading import load_engine
from engine.options import EngineOptions
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput, Sequence
from engine.vision.placement import place_images
from engine.vision.preprocess import ImageProcessorConfig, ProcessedImage, decode_image, preprocess, to_rgb

Prompt = Union[list[int], dict[str, Any]]


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", dtype: str = "bfloat16", max_num_seqs: int = 8,
                 max_model_len: int = 8192, page_size: int = 64, max_num_batched_tokens: int = 2048,
                 cuda_graphs: bool = True, moe_vram_budget: int | None = None, prefix_cache: bool = True,
                 pcie_expert_percent: int | None = None, **options) -> None:
        """`options`: the rest of EngineOptions' fields (engine_core.py), by name."""
        engine = EngineOptions(max_num_seqs, max_model_len, max_num_batched_tokens, page_size=page_size,
                               cuda_graphs=cuda_graphs, moe_vram_budget=moe_vram_budget, prefix_cache=prefix_cache,
                               pcie_expert_percent=pcie_expert_percent, **options)
        self._init(load_engine(model, device, dtype, engine), ImageProcessorConfig.from_snapshot(model))

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: LoadedWeights, **options) -> "LLM":
        """An engine over weights already in memory (synthetic benchmarks); device and dtype follow them."""
        llm = cls.__new__(cls)
        llm._init(EngineCore(config, weights, EngineOptions(**options)), ImageProcessorConfig())
        return llm

    def _init(self, core: EngineCore, image_config: ImageProcessorConfig) -> None:
        self.core, self.config, self.model = core, core.config, core.model
        self.scheduler, self.runner = core.scheduler, core.runner
        self.image_config = image_config
        self._ids = itertools.count()

    def generate(self, prompts: list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self._sequence(prompt, p) for prompt, p in zip(prompts, per_prompt)]
        for seq in seqs:
            self.core.add(seq)
        while self.core.has_work:
            self.core.step()
        return [RequestOutput(s.request_id, s.prompt_token_ids, s.output_token_ids, s.finish_reason,
                              s.prompt_logprobs if s.params.prompt_logprobs is not None else None,
                              s.cached_prompt_tokens) for s in seqs]

    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """fp32 logits [len, vocab] for every prompt position, from one prefill."""
        return self._prefill_once(prompt)

    def layer_outputs(self, prompt: Prompt) -> list[torch.Tensor]:
        """The mHC streams [len, S, D] after each decoder layer (for finding where a checkpoint diverges)."""
        outputs: list[torch.Tensor] = []
        self._prefill_once(prompt, outputs)
        return outputs

    def _prefill_once(self, prompt: Prompt, layer_outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self.core.score_prompt(self._sequence(prompt, SamplingParams(max_tokens=1)), layer_outputs)

    def _sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        if not isinstance(prompt, dict):
            return Sequence(str(next(self._ids)), list(prompt), params)
        images = [self._processed(image) for image in (prompt.get("multi_modal_data") or {}).get("image", [])]
        token_ids, placed = list(prompt["prompt_token_ids"]), ()
        if images:
            if not self.core.accepts_images:
                raise ValueError("this model has no vision tower: it answers text only")
            vision = self.config.vision
            token_ids, placed = place_images(token_ids, images, vision.image_token_id, vision.video_start_token_id,
                                             vision.video_end_token_id)
        return Sequence(str(next(self._ids)), token_ids, params, images=placed)

    def _processed(self, image: Image.Image | bytes | ProcessedImage) -> ProcessedImage:
        if isinstance(image, ProcessedImage):
            return image
        rgb = decode_image(image, self.image_config) if isinstance(image, bytes) else to_rgb(image)
        return preprocess(rgb, self.image_config)
