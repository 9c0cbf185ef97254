"""Models from files to an engine: the face the worker, `LLM` and tools load and place models through.

A load makes the memory plan first (engine/memory_plan.py: from the weights' sizes on disk, before a byte is
read), then reads the weights into the places it gives: from a prepared snapshot at disk speed, or from the
checkpoint, converted as it is read. With `partial` the routed experts are left to fill in while the engine
serves (`ExpertAvailability`). A cold start's prepared snapshot is written later from the weights in memory
(`PreparedWrite`). What lies behind (checkpoint formats, the prepared snapshot's files, expert placement) is
the engine's own business.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from engine.checkpoint.availability import ExpertAvailability
from engine.checkpoint.layout import is_expert_stack
from engine.checkpoint.loader import LoadedWeights, checkpoint_sizes, has_mtp_layer, load_weights, open_weights
from engine.checkpoint.prepared import (FORMAT_VERSION, below_layer, engine_version, holds_layer, load_prepared,
                                        open_prepared, prepared_sizes, save_prepared)
from engine.checkpoint.prepared_store import (PreparedPlan, PreparedSnapshotError, check_prepared, discard_prepared,
                                              invalidate_prepared, read_plan)
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.memory_plan import MemoryPlan, plan_memory
from engine.options import EngineOptions
from engine.prefill_chunk import measured_prefill_rates
from engine.warm_up import start_warm_up

__all__ = ["DTYPES", "ExpertAvailability", "LoadedModelWeights", "PreparedSnapshotError", "PreparedWrite",
           "discard_prepared", "engine_version", "invalidate_prepared", "load_checkpoint", "load_engine",
           "load_prepared_snapshot", "prepared_problems", "prepared_source"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModelWeights:
    config: ModelConfig
    weights: LoadedWeights
    plan: MemoryPlan  # the memory plan the weights were placed by; the engine takes it
    experts: ExpertAvailability | None = None  # partial: the routed experts still to fill in
    bytes_read: int = 0
    gb_per_s: float = 0.0


def load_prepared_snapshot(prepared: Path, files: Path, device: torch.device, dtype: str, options: EngineOptions,
                           workers: int, partial: bool = False,
                           on_damaged: Callable[[PreparedSnapshotError], None] = lambda error: None
                           ) -> LoadedModelWeights:
    """The weights of a prepared snapshot (config from `files`), every piece hash-checked; PreparedSnapshotError
    when it is damaged (the caller falls back to the checkpoint). With `partial`, `on_damaged` runs for an
    expert piece found damaged after the load returned."""
    config = ModelConfig.from_dir(files)
    start_warm_up(config, device, DTYPES[dtype], options.kernels_file, options.precompile_processes)
    layers = None if _runs_mtp(options, partial) else config.num_layers  # an MTP layer nothing runs stays unread
    plan = plan_memory(config, options, device, DTYPES[dtype],
                       prepared_sizes(below_layer(read_plan(prepared).meta, layers)),
                       measure_rates=lambda: measured_prefill_rates(device))
    experts = None
    if partial:
        weights, stats, experts = open_prepared(prepared, device, workers, expert_slots=plan.expert_slots,
                                                on_damaged=on_damaged, layers=layers)
    else:
        weights, stats = load_prepared(prepared, device, workers, expert_slots=plan.expert_slots, layers=layers)
    return LoadedModelWeights(config, weights, plan, experts, stats.bytes, stats.gb_per_s)


def load_checkpoint(files: Path, device: torch.device, dtype: str, options: EngineOptions, workers: int,
                    partial: bool = False, progress: Callable[[int, int], None] | None = None) -> LoadedModelWeights:
    """The weights of a checkpoint's safetensors (any of its formats), converted as they are read;
    `progress(done_bytes, total_bytes)` follows the reads."""
    config = ModelConfig.from_dir(files)
    start_warm_up(config, device, DTYPES[dtype], options.kernels_file, options.precompile_processes)
    sizes = checkpoint_sizes(files, config, mtp=_runs_mtp(options, partial))
    plan = plan_memory(config, options, device, DTYPES[dtype], sizes,
                       measure_rates=lambda: measured_prefill_rates(device))
    read = [0]

    def count(done: int, total: int) -> None:
        read[0] = done
        if progress is not None:
            progress(done, total)

    experts = None
    if partial:
        weights, experts = open_weights(files, config, device, DTYPES[dtype], plan.expert_slots, workers, count)
    else:
        weights = load_weights(files, config, device, DTYPES[dtype], plan.expert_slots, workers, count,
                               mtp=_runs_mtp(options, partial))
    return LoadedModelWeights(config, weights, plan, experts, read[0])


def load_engine(model: str | Path, device: str = "cpu", dtype: str = "bfloat16",
                options: EngineOptions = EngineOptions()) -> EngineCore:
    """An engine over a checkpoint directory, with its tokenizer when it has one (the offline `LLM`, tests)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    loaded = load_checkpoint(Path(model), torch.device(device), dtype, options, workers=8)
    tokenizer_file = Path(model) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.exists() else None
    return EngineCore(loaded.config, loaded.weights, options, tokenizer, plan=loaded.plan)


def prepared_problems(prepared: Path, files: Path, options: EngineOptions, partial: bool = False) -> list[str]:
    """Why the prepared snapshot at `prepared` cannot serve this start (empty: it can): unreadable by this engine,
    or written without the MTP layer that drafts need while the checkpoint at `files` has one (a start with drafts
    off wrote it; the next cold start writes it with the layer). Cheap: listings, sizes, versions and safetensors
    headers, no data read."""
    problems = check_prepared(prepared, FORMAT_VERSION, engine_version())
    if problems or not _runs_mtp(options, partial):
        return problems
    config = ModelConfig.from_dir(files)
    if config.num_mtp_layers and not holds_layer(read_plan(prepared).meta, config.num_layers) and \
            has_mtp_layer(files, config):
        return [f"{prepared}: written without the MTP layer (layer {config.num_layers}) that drafts need"]
    return []


def _runs_mtp(options: EngineOptions, partial: bool) -> bool:
    """Whether a load brings the MTP layer: where drafts are on, and the load is whole (one that readies before its
    routed experts are in reads none: engine/build.py's `mtp_drafter`)."""
    return options.drafts_on and not partial


def prepared_source(prepared: Path) -> dict | None:
    """What the prepared snapshot was made from, as its writer recorded it (`PreparedWrite.meta["source"]`)."""
    return read_plan(prepared).meta.get("source")


@dataclass
class PreparedWrite:
    """A cold start's prepared snapshot, to be written from the weights in memory once the worker serves.

    The engine may rebind entries of the weights dict to views of its fused buffers (the same bytes)
    and moves the routed expert stacks out of it into its host bank; those are held here by reference
    (no copy) until written.
    """

    directory: Path
    meta: dict
    weights: LoadedWeights
    names: list[str] = field(init=False)
    expert_stacks: dict = field(init=False)

    def __post_init__(self) -> None:
        self.names = list(self.weights)
        self.expert_stacks = {n: w for n, w in self.weights.items() if is_expert_stack(n)}

    def write(self, workers: int, stop: threading.Event | None = None,
              pace: Callable[[int], None] | None = None) -> PreparedPlan:
        final = {n: self.weights[n] if n in self.weights else self.expert_stacks.get(n) for n in self.names}
        gone = [n for n, w in final.items() if w is None]
        if gone:
            raise PreparedSnapshotError(f"weights {gone[:3]} left the engine before the prepared snapshot was written")
        try:
            return save_prepared(final, self.directory, self.meta, workers, stop, pace)
        finally:
            self.expert_stacks = {}
