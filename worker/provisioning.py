"""From a model source to weights in memory, by the cheapest valid path: fast_resume or cold.

fast_resume: the prepared snapshot for this model, dtype, format and engine version is on the
volume; it is read at disk speed, every piece hash-checked. cold: download (resumable, verified)
-> verify -> prepare (convert once, write the prepared snapshot) -> load. A damaged prepared
snapshot found while loading is reported, removed and rebuilt from the original files ("repair").
Blocking; runs in a worker thread while the server answers /health and /ready.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint.loader import LoadedWeights, checkpoint_sizes, load_weights
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version, load_prepared, prepared_sizes, save_prepared
from engine.config import ModelConfig
from engine.engine_core import DTYPES, EngineCore
from engine.offload.placement import WeightBytes, plan_load
from engine.tiny.factory import write_tiny_model
from provision.cache import check_snapshot
from provision.download import DownloadProgress, download_snapshot
from provision.errors import ProvisionError
from engine.checkpoint.prepared_store import PreparedSnapshotError, check_prepared, read_plan
from provision.settings import Settings
from provision.sources import source_for
from provision.stages import StageClock
from worker.engine_options import engine_options

log = logging.getLogger("glmflash.provision")
TINY_NAME = "glmflash-tiny"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: LoadedWeights
    files: Path  # config, tokenizer and chat template live here
    name: str
    moe_vram_budget: int | str | None = None  # as resolved for this device and model (engine_core.EngineOptions)


def model_spec(settings: Settings) -> tuple[str, str]:
    """(source spec, served name). No model configured: the embedded tiny model, written on first use."""
    if settings.s3_uri or settings.model:
        spec = settings.s3_uri or settings.model
        default = Path(spec).name if Path(spec).is_dir() else spec.rstrip("/").split("@")[0].removeprefix("s3://")
        return spec, settings.served_model_name or default
    tiny = settings.cache_dir / "tiny-src"
    if not (tiny / "model.safetensors.index.json").exists():
        write_tiny_model(tiny)
    return str(tiny), settings.served_model_name or TINY_NAME


def provision_and_load(settings: Settings, clock: StageClock) -> LoadedModel:
    spec, name = model_spec(settings)
    device, dtype = torch.device(settings.resolved_device()), settings.resolved_dtype()
    home = settings.cache_dir / "models" / _slug(spec, settings.model_revision)
    snapshot, prepared = home / "snapshot", home / "prepared"
    wanted = {"spec": spec, "revision": settings.model_revision, "dtype": dtype}
    problems = _resume_problems(snapshot, prepared, wanted)
    if not problems:
        clock.stage("fast_resume")
        clock.stage("load", path=str(prepared))
        try:
            config = ModelConfig.from_dir(snapshot)
            budget, slots = _placement(settings, config, device, prepared_sizes(read_plan(prepared).meta))
            weights, stats = load_prepared(prepared, device, settings.download_workers, expert_slots=slots)
            clock.progress(read_gb_s=round(stats.gb_per_s, 3), bytes=stats.bytes)
            return LoadedModel(config, weights, snapshot, name, budget)
        except PreparedSnapshotError as exc:
            clock.stage("repair", reason=_quote(str(exc)))
            shutil.rmtree(prepared, ignore_errors=True)
            problems = [str(exc)]
    clock.stage("cold", reason=_quote(problems[0]))
    source = source_for(spec, settings)
    clock.stage("download", source=source.describe().uri)
    download_snapshot(source, snapshot, settings.download_workers, on_progress=_progress(clock))
    clock.stage("verify")
    status = check_snapshot(snapshot)
    if not status.ok:
        raise ProvisionError(f"{snapshot}: snapshot still {status.state} after download: {status.problems[:3]}")
    clock.stage("prepare", path=str(prepared))
    config = ModelConfig.from_dir(snapshot)
    budget, slots = _placement(settings, config, device, checkpoint_sizes(snapshot, config))
    weights = load_weights(snapshot, config, device, DTYPES[dtype], slots)
    save_prepared(weights, prepared, {"source": wanted})
    clock.stage("load", path="in-memory (converted)")
    return LoadedModel(config, weights, snapshot, name, budget)


def _placement(settings: Settings, config: ModelConfig, device: torch.device, sizes: WeightBytes
               ) -> tuple[int | str | None, int | None]:
    """(expert budget to serve with, routed experts per MoE layer to load onto the device) for these weights."""
    dtype = DTYPES[settings.resolved_dtype()]
    caches = EngineCore.cache_bytes(config, engine_options(settings), dtype)
    return plan_load(settings.moe_vram_budget_bytes, device, sizes, len(config.moe_layers),
                     config.n_routed_experts, caches)


def _resume_problems(snapshot: Path, prepared: Path, wanted: dict) -> list[str]:
    """Why fast_resume cannot be taken (empty: it can). Cheap: sizes and versions, no data read."""
    status = check_snapshot(snapshot)
    if not status.ok:
        return [f"snapshot {status.state}: {'; '.join(status.problems[:2]) or snapshot}"]
    problems = check_prepared(prepared, FORMAT_VERSION, engine_version())
    if problems:
        return problems
    recorded = read_plan(prepared).meta.get("source")
    return [] if recorded == wanted else [f"prepared for {recorded}, wanted {wanted}"]


def _progress(clock: StageClock):
    def report(p: DownloadProgress) -> None:
        clock.progress(done_bytes=p.done_bytes, total_bytes=p.total_bytes, done_files=p.done_files,
                       total_files=p.total_files)

    return report


def _slug(spec: str, revision: str | None) -> str:
    key = f"{spec}@{revision or ''}"
    readable = "".join(c if c.isalnum() or c in "-_." else "-" for c in spec.rstrip("/").split("/")[-1])[:48]
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _quote(text: str) -> str:
    return '"' + text.replace('"', "'")[:200] + '"'
