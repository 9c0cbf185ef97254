"""The engine's options: the sizes its memory plan follows (engine/memory_plan.py), hybrid offload's knobs, the
prefix cache's budgets. Every field has its default here; the worker's settings and `LLM` fill them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int = 8
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    # Tokens a step may take when no request is decoding (a lone long prompt, or prompts arriving together): under
    # hybrid offload every prefill chunk brings each host expert over the link once, so a longer chunk spreads that
    # copy over more tokens, while decoding requests keep steps of max_num_batched_tokens. None: the same budget.
    # The memory plan reserves for the larger step.
    max_prefill_tokens: int | None = None
    max_waiting: int = 256
    page_size: int = 64
    # The DSA latent cache (latents and the indexer's pooled keys; as vLLM's kv_cache_dtype): "auto" in the
    # activations' dtype, "fp8" in e4m3 with an fp32 scale per 128 elements: about half the bytes a token, so
    # about twice the context in the same memory (engine/cache/paged_latents.py).
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    cuda_graphs: bool = True  # capture decode steps at load (CUDA with the Triton kernels only)
    # Bytes of device memory for routed experts, the rest in host RAM; "auto": what the other weights and the
    # caches leave; None: every expert resident where the weights fit (engine/memory_plan.py decides).
    moe_vram_budget: int | str | None = None
    max_expert_swaps: int = 4  # host experts moved into device slots between two steps, at most
    cpu_expert_threads: int | None = None  # threads of the CPU expert executor; None: torch's thread count
    cpu_expert_pin: bool = True  # with a GPU, one core per CPU expert thread where the CPU mask allows
    # Share (percent) of a decode step's missed experts copied over PCIe and run on the GPU, the rest on the
    # CPU; None: from the two rates measured at load (CUDA), 0 elsewhere.
    pcie_expert_percent: int | None = None
    miss_split_file: Path | None = None  # where the measured CPU and PCIe rates are kept between starts
    kernels_file: Path | None = None  # the Triton specializations compiled, preloaded by the next start
    precompile_processes: int | None = None  # children compiling them meanwhile (0: none; None: by the cores)
    prefix_cache: bool = True  # start requests from the saved state of their longest cached prefix
    prefix_cache_bytes: int = 4 << 30  # device memory for cached prefixes (snapshots and extra pages)
    prefix_cache_host_bytes: int = 0  # host RAM for prefixes evicted from the device (0: none, evictions drop)
    # Load the checkpoint's MTP layer and run it after every step, drafting the tokens after each sampled one and
    # counting how often the first draft is right (engine/mtp_drafter.py); under hybrid offload its experts are
    # placed with the other layers'.
    mtp_drafts: bool = False
    # Speculative decoding: up to this many MTP drafts verified in each decoding request's next step (0: off; on
    # turns mtp_drafts on): up to k + 1 tokens a step, the same tokens as without (greedy), the same distribution
    # (sampling).
    speculative_tokens: int = 0
    # With speculative_tokens: each step's number of drafts (0 to speculative_tokens) chosen from the acceptance and
    # step times measured (engine/draft_length.py); off: always speculative_tokens.
    measured_draft_length: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {self.max_prefill_tokens}")

    @property
    def largest_step(self) -> int:
        """Tokens of the largest step the engine takes (what its transient memory is reserved for)."""
        return max(self.max_num_batched_tokens, self.max_prefill_tokens or 0, self.max_num_seqs)

    @property
    def fp8_latents(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def drafts_on(self) -> bool:
        """Whether the MTP layer runs (drafting, verified or not)."""
        return self.mtp_drafts or self.speculative_tokens > 0
