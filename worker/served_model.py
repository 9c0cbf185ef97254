"""What the HTTP side needs of a loaded model: the async engine, its tokenizer, chat template and limits."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore, EngineOptions
from engine.sampler import LogitsProcessor
from engine.sampling_params import SamplingParams
from provision.settings import Settings
from worker.chat_template import ChatTemplate

log = logging.getLogger("glmflash.worker")


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    template: ChatTemplate | None
    max_model_len: int
    vocab_size: int
    logits_processors: tuple[LogitsProcessor, ...] = ()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def load_served_model(snapshot: Path, settings: Settings, name: str) -> ServedModel:
    """Blocking: read the snapshot into an engine (call from a worker thread)."""
    start = time.perf_counter()
    options = EngineOptions(max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
                            max_num_batched_tokens=settings.max_num_batched_tokens, max_waiting=settings.max_queue)
    core = EngineCore.from_snapshot(snapshot, settings.resolved_device(), settings.resolved_dtype(), options)
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    template = ChatTemplate.from_dir(snapshot) if _has_template(snapshot) else None
    log.info("event=model_loaded model=%s device=%s dtype=%s load_s=%.2f", name, settings.resolved_device(),
             settings.resolved_dtype(), time.perf_counter() - start)
    return ServedModel(name, AsyncEngine(core, tokenizer), tokenizer, template, settings.max_model_len,
                       core.config.vocab_size)


def _has_template(snapshot: Path) -> bool:
    if (snapshot / "chat_template.jinja").exists():
        return True
    config = snapshot / "tokenizer_config.json"
    return config.exists() and '"chat_template"' in config.read_text()


async def warm_up(model: ServedModel) -> None:
    """One short request through the whole path, so the first user request meets warm kernels."""
    stream = await model.engine.generate(model.encode("warm up"), SamplingParams(max_tokens=2, temperature=0.0))
    async for _ in stream:
        pass
