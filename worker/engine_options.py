"""The engine's options as the settings give them (one place, for the memory plan made before loading and for the
engine)."""

from __future__ import annotations

from pathlib import Path

from engine.options import EngineOptions
from worker.settings import Settings


def engine_options(settings: Settings, miss_split_file: Path | None = None,
                   kernels_file: Path | None = None) -> EngineOptions:
    return EngineOptions(max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
                         max_num_batched_tokens=settings.max_num_batched_tokens, max_waiting=settings.max_queue,
                         max_prefill_tokens=settings.max_prefill_tokens,
                         kv_cache_dtype=settings.kv_cache_dtype,
                         moe_vram_budget=settings.moe_vram_budget_bytes, cpu_expert_threads=settings.cpu_expert_threads,
                         cpu_expert_pin=settings.cpu_expert_pin,
                         pcie_expert_percent=settings.pcie_expert_percent, miss_split_file=miss_split_file,
                         kernels_file=kernels_file, precompile_processes=settings.kernel_precompile_processes,
                         prefix_cache=settings.prefix_cache, prefix_cache_bytes=settings.prefix_cache_bytes,
                         prefix_cache_host_bytes=settings.prefix_cache_host_bytes, mtp_drafts=settings.mtp_drafts,
                         speculative_tokens=settings.speculative_tokens,
                         measured_draft_length=settings.measured_draft_length)
