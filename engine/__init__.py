"""glmflash engine: the glm5_next model, checkpoint formats, kernels, cache, scheduler and sampler."""

from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
