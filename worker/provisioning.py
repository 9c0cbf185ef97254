"""From a model source to weights in memory, by the cheapest valid path: fast_resume or cold.

fast_resume: the prepared snapshot for these files, dtype, format and engine version is on the
volume; it is read at disk speed, every piece hash-checked. cold: download -> verify -> prepare (the
original safetensors read once, in parallel, each weight converted and put straight in its place)
-> load. A local directory is read in place: nothing is copied into the cache, which then holds
only the prepared snapshot. A hub or S3 snapshot is downloaded (resumable, verified) into the cache
and read in place from there. The prepared snapshot of a cold start is written from the weights in
memory once the worker serves (`PreparedWrite`, `BackgroundPrepare`), so ready does not wait for
it and the next start is a fast_resume. A damaged prepared snapshot found while loading is
reported, removed and rebuilt ("repair"); one found after a partial load (ready_at=partial reads the
experts while serving) is invalidated, so the next start is cold.
Blocking; runs in a worker thread while the server answers /health and /ready.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.config import ModelConfig
from engine.cpu_cores import usable_cores
from engine.loading import (ExpertAvailability, LoadedModelWeights, PreparedSnapshotError, PreparedWrite,
                            discard_prepared, invalidate_prepared, load_checkpoint, load_prepared_snapshot,
                            prepared_problems, prepared_source)
from engine.memory_plan import MemoryPlan
from engine.options import EngineOptions
from engine.tiny.factory import write_tiny_model
from provision.cache import PREPARED_DIRNAME, check_snapshot, model_home
from provision.download import DownloadProgress, download_snapshot
from provision.errors import ProvisionError
from provision.sources import LocalSource, Source, SourceInfo, source_for
from provision.stages import StageClock
from worker.engine_options import engine_options
from worker.prepare_pace import ServingFirst
from worker.settings import Settings

log = logging.getLogger("glmflash.provision")
TINY_NAME = "glmflash-tiny"


MISS_SPLIT_FILE = "miss_split.json"
KERNELS_FILE = "kernels.json"  # the Triton specializations the model compiled, preloaded at the next start


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict  # engine/loading.py's weights by name, placed by `plan`
    files: Path  # config, tokenizer and chat template live here
    name: str
    plan: MemoryPlan | None = None  # the memory plan the weights were loaded under (engine/memory_plan.py)
    prepare: PreparedWrite | None = None  # a cold start's prepared snapshot, written after ready
    # ready_at=partial: the routed experts still to fill in (worker.serve starts the fill)
    experts: ExpertAvailability | None = None
    miss_split_file: Path | None = None  # hybrid offload's measured CPU and PCIe rates, beside the prepared snapshot
    kernels_file: Path | None = None  # the compiled kernels' manifest, beside it too


class BackgroundPrepare:
    """Writes a cold start's prepared snapshot on its own thread while the worker serves.

    /ready shows `prepared_snapshot`: writing, written, failed or stopped. A write that does not
    finish leaves nothing a later start trusts (that start is cold again); one stopped keeps the pieces it
    wrote, and the next cold start's write resumes from them.
    """

    def __init__(self, job: PreparedWrite, workers: int, clock: StageClock,
                 on_done: Callable[[], None] = lambda: None, busy: Callable[[], bool] = lambda: False,
                 busy_bytes_per_s: float = 0.0) -> None:
        """on_done: called once the write has ended, whatever its outcome; `busy()`: whether requests run, when
        the write yields to them (`worker.prepare_pace`)."""
        self.job, self.workers, self.clock, self.on_done = job, workers, clock, on_done
        self.cancel = threading.Event()
        self.pace = ServingFirst(busy, busy_bytes_per_s, self.cancel.wait)
        self.thread = threading.Thread(target=self._run, name="glmflash-prepare", daemon=True)

    def start(self) -> None:
        """Start writing; /ready already says `prepared_snapshot=writing` (the ready stage carries it)."""
        self.thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            plan = self.job.write(self.workers, self.cancel, self.pace)
        except Exception as exc:
            self.on_done()
            state = "stopped" if self.cancel.is_set() else "failed"
            log.warning("event=prepared_snapshot state=%s path=%s next_start=%s error=%s", state, self.job.directory,
                        "resumes" if state == "stopped" else "rewrites", _quote(str(exc)))
            self.clock.progress(prepared_snapshot=state)
            return
        self.on_done()
        seconds = time.perf_counter() - start
        size = sum(plan.files.values())
        log.info("event=prepared_snapshot state=written path=%s bytes=%d seconds=%.2f gb_s=%.3f workers=%d "
                 "yielded_s=%.2f", self.job.directory, size, seconds, size / seconds / 1e9 if seconds else 0.0,
                 self.workers, self.pace.paced_s)
        self.clock.progress(prepared_snapshot="written", prepared_s=round(seconds, 3))

    def stop(self, within_s: float | None) -> None:
        """Wait for the write to end: all of it (None), or at most `within_s` seconds (what a stop's grace has
        left), then it is stopped where it is, its pieces kept for the next start to resume."""
        if self.thread.is_alive():
            self.thread.join(within_s)
        self.cancel.set()
        if self.thread.is_alive():
            self.thread.join()


def cpu_workers(settings: Settings) -> int:
    """Threads for work that is mostly CPU (hashing, copies): the parallel-read count, at most one per usable
    core (a CPU quota counts)."""
    return max(1, min(settings.download_workers, usable_cores()))


def model_spec(settings: Settings) -> tuple[str, str]:
    """(source spec, served name). No model configured: the embedded tiny model, written on first use."""
    if settings.model_source:
        spec = settings.model_source
        default = Path(spec).name if Path(spec).is_dir() else spec.rstrip("/").split("@")[0].removeprefix("s3://")
        return spec, settings.served_model_name or default
    tiny = settings.cache_dir / "tiny-src"
    if not (tiny / "model.safetensors.index.json").exists():
        write_tiny_model(tiny, num_nextn_predict_layers=1)  # an MTP layer as the release has: drafts can run
    return str(tiny), settings.served_model_name or TINY_NAME


def provision_and_load(settings: Settings, clock: StageClock) -> LoadedModel:
    spec, name = model_spec(settings)
    device, dtype = torch.device(settings.resolved_device()), settings.resolved_dtype()
    home = model_home(settings.cache_dir, spec, settings.model_revision)
    prepared, kernels_file = home / PREPARED_DIRNAME, home / KERNELS_FILE
    source = source_for(spec, revision=settings.model_revision, token=settings.hf_token,
                        endpoint_url=settings.s3_endpoint_url, workers=settings.download_workers)
    files = source.root if isinstance(source, LocalSource) else home / "snapshot"
    wanted = {"spec": spec, "revision": settings.model_revision, "dtype": dtype}
    options = engine_options(settings, kernels_file=kernels_file)
    partial = settings.ready_at == "partial"
    problems = _resume_problems(source, files, prepared, wanted, options, partial)
    rss_before = _rss_gib()
    if not problems:
        clock.stage("fast_resume")
        clock.stage("load", path=str(prepared))
        try:
            loaded = load_prepared_snapshot(prepared, files, device, dtype, options, settings.download_workers, partial,
                                            on_damaged=functools.partial(_invalidate_prepared, prepared))
            if partial:
                clock.progress(experts="deferred")
            clock.progress(read_gb_s=round(loaded.gb_per_s, 3), bytes=loaded.bytes_read, **_host_memory(rss_before))
            return _loaded_model(loaded, files, name, home, kernels_file)
        except PreparedSnapshotError as exc:
            clock.stage("repair", reason=_quote(str(exc)))
            problems = [str(exc)]
    clock.stage("cold", reason=_quote(problems[0]))
    discard_prepared(prepared, keep_partial=lambda meta: {k: v for k, v in meta.get("source", {}).items()
                                                          if k != "files"} == wanted)
    identity = _fetch(source, files, settings, clock)
    clock.stage("prepare", path=str(prepared), written="after_ready")
    start = time.perf_counter()
    loaded = load_checkpoint(files, device, dtype, options, settings.download_workers, partial,
                             lambda done, total: clock.progress(done_bytes=done, total_bytes=total))
    seconds = time.perf_counter() - start
    clock.stage("load", path="in-memory (converted)", bytes=loaded.bytes_read,
                read_gb_s=round(loaded.bytes_read / seconds / 1e9, 3), **_host_memory(rss_before),
                **({"experts": "deferred"} if partial else {}))
    job = PreparedWrite(prepared, {"source": {**wanted, "files": identity.to_dict()}}, loaded.weights)
    return _loaded_model(loaded, files, name, home, kernels_file, job)


def _loaded_model(loaded: LoadedModelWeights, files: Path, name: str, home: Path, kernels_file: Path,
                  job: PreparedWrite | None = None) -> LoadedModel:
    return LoadedModel(loaded.config, loaded.weights, files, name, loaded.plan, job, loaded.experts,
                       home / MISS_SPLIT_FILE, kernels_file)


def _rss_gib() -> float:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (OSError, ValueError, IndexError):
        return 0.0


def _host_memory(rss_before: float) -> dict[str, float]:
    """Host RAM of the load: resident before it, the process's peak by its end (the peak covers the whole
    load: its buffers, staging and the host bank), for the stage line and /ready."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30  # Linux reports KiB
    return {"rss_before_gib": round(rss_before, 2), "peak_rss_gib": round(peak, 2)}


def _invalidate_prepared(prepared: Path, error: PreparedSnapshotError) -> None:
    """An expert piece found damaged after a partial fast_resume (the fill or a step read it): this start cannot
    fall back any more (those experts fail, the fill too), but the next one must not trust the snapshot."""
    if invalidate_prepared(prepared):
        log.error("event=prepared_snapshot state=invalidated path=%s file=%s piece=%s next_start=cold error=%s",
                  prepared, error.file, error.piece, _quote(str(error)))


def _fetch(source: Source, files: Path, settings: Settings, clock: StageClock) -> SourceInfo:
    """Make the source's files readable at `files`; returns what they are (the prepared snapshot records it).

    A local directory is used where it is (nothing copied); others are downloaded into the cache."""
    if isinstance(source, LocalSource):
        clock.stage("download", source=source.describe().uri, in_place="true")
        listed = source.list_files()
        clock.stage("verify", files=len(listed), bytes=sum(f.size for f in listed))
        return source.describe()
    clock.stage("download", source=source.describe().uri)
    download_snapshot(source, files, settings.download_workers, on_progress=_progress(clock))
    clock.stage("verify")
    status = check_snapshot(files)
    if not status.ok or status.manifest is None:
        raise ProvisionError(f"{files}: snapshot still {status.state} after download: {status.problems[:3]}")
    return status.manifest.source


def _resume_problems(source: Source, files: Path, prepared: Path, wanted: dict, options: EngineOptions,
                     partial: bool) -> list[str]:
    """Why fast_resume cannot be taken (empty: it can). Cheap: listings, sizes, versions and headers, no data
    read."""
    if isinstance(source, LocalSource):
        identity = source.describe()
    else:
        status = check_snapshot(files)
        if not status.ok or status.manifest is None:
            return [f"snapshot {status.state}: {'; '.join(status.problems[:2]) or files}"]
        identity = status.manifest.source
    problems = prepared_problems(prepared, files, options, partial)
    if problems:
        return problems
    recorded, want = prepared_source(prepared), {**wanted, "files": identity.to_dict()}
    return [] if recorded == want else [f"prepared for {recorded}, wanted {want}"]


def _progress(clock: StageClock):
    def report(p: DownloadProgress) -> None:
        clock.progress(done_bytes=p.done_bytes, total_bytes=p.total_bytes, done_files=p.done_files,
                       total_files=p.total_files)

    return report


def _quote(text: str) -> str:
    return '"' + text.replace('"', "'")[:200] + '"'
