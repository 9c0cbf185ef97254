"""glmflash engine: the glm5_next model, checkpoint formats, kernels, cache, scheduler and sampler.

`LLM` and `SamplingParams` load on first use: a process that needs one kernel module (a compile child, a
tool) does not import the whole engine with it."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "SamplingParams"]
_WHERE = {"LLM": "engine.llm", "SamplingParams": "engine.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
