"""One request's life: its tokens, its state slot and cache pages, and why it finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.constraint import RequestConstraint
    from engine.vision.placement import PlacedImage


@dataclass
class TokenLogprobs:
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(eq=False)  # identity: a request is itself, whatever its tokens
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose state is already in the slot and pages
    cached_prompt_tokens: int = 0  # prompt tokens restored from the prefix cache instead of computed
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    constraint: RequestConstraint | None = None  # grammar / reasoning budget state, when the params ask for one
    # With params.prompt_logprobs: prompt tokens 1.. as their prefill chunks ran (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # time.perf_counter() when the engine took the request and when a step first ran it (None: not yet).
    arrived: float = 0.0
    started: float | None = None
    images: tuple[PlacedImage, ...] = ()  # the prompt's images, each over its run of image tokens
    # The MTP layer's drafts of the tokens after the last one (with drafts on; empty: none).
    draft_tokens: tuple[int, ...] = ()
    # The prompt as the prefix cache keys it: image tokens replaced by their image's content key.
    prompt_keys: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if not self.prompt_keys:
            self.prompt_keys = self.prompt_token_ids
            for image in self.images:
                self.prompt_keys = self.prompt_keys[:image.start] + [image.key] * (image.end - image.start) \
                    + self.prompt_keys[image.end:]

    @property
    def key_ids(self) -> list[int]:
        """`token_ids` as the prefix cache keys them (`prompt_keys`, then the output)."""
        return self.prompt_keys + self.output_token_ids

    def images_in(self, start: int, end: int) -> list[PlacedImage]:
        """The images with tokens among positions [start, end)."""
        return [image for image in self.images if image.start < end and start < image.end]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_to_compute(self) -> int:
        """Known tokens not yet run through the model (the prompt remainder, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, eos_ids: tuple[int, ...]) -> None:
        self.output_token_ids.append(token)
        stops = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(eos_ids))
        if token in stops:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    prompt_logprobs: list[TokenLogprobs] | None = None  # with params.prompt_logprobs: prompt tokens 1..
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache
