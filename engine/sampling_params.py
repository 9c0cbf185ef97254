"""Per-request generation settings (the offline API's `SamplingParams`, also built by the server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.structured.spec import GrammarSpec, Reasoning


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI semantics: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and generated tokens (divide positive logits, multiply negative)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # applied by the detokenizing layer (AsyncEngine)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top k
    # None: off; k >= 0: each prompt token's logprob (from the second on) plus the top k at its position.
    # Such a request computes its whole prompt (no prefix-cache hit): the logprobs need every position.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Callables (token ids so far, logits [V]) -> logits, applied in order before sampling (constrained output).
    logits_processors: list[Callable[[list[int], Any], Any]] = field(default_factory=list)
    grammar: GrammarSpec | None = None  # the output (after any reasoning) must match it
    reasoning: Reasoning | None = None  # the output starts in reasoning: where it ends, and its budget

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
