"""Boot: the cheapest valid start path is taken (cold, fast_resume, repair), a local source is read in
place, the prepared snapshot is written after ready (and never trusted half-written), SIGTERM drains,
idle parks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from engine.checkpoint.loader import checkpoint_sizes, load_weights
from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version, load_prepared
from engine.checkpoint.prepared_store import JOURNAL_NAME, PLAN_NAME, check_prepared, partial_dir, read_plan
from engine.tiny.factory import write_tiny_model
from provision.stages import StageClock
from server_helpers import free_port
from worker.provisioning import provision_and_load
from worker.served_model import build_served_model
from worker.settings import Settings


def boot_stages(settings: Settings) -> list[str]:
    """One start's stages; a cold start's prepared snapshot is then written, as the server does after ready."""
    clock = StageClock(300)
    loaded = provision_and_load(settings, clock)
    assert loaded.weights and loaded.config.num_layers == 8
    if loaded.prepare is not None:
        loaded.prepare.write(workers=2)
    return [name for name, _ in clock.history]


COLD = ["cold", "download", "verify", "prepare", "load"]
FAST = ["fast_resume", "load"]


@pytest.fixture()
def local_settings(tmp_path) -> Settings:
    src = write_tiny_model(tmp_path / "src", "nvfp4-ct")
    return Settings(model=str(src), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")


@pytest.fixture()
def s3_settings(tmp_path, s3, moto_endpoint) -> Settings:
    src = write_tiny_model(tmp_path / "src", "nvfp4-modelopt")
    s3.create_bucket(Bucket="models")
    for path in src.iterdir():
        s3.upload_file(str(path), "models", f"glm/tiny/{path.name}")
    return Settings(s3_uri="s3://models/glm/tiny", s3_endpoint_url=moto_endpoint, cache_dir=tmp_path / "cache",
                    device="cpu", dtype="float32")


def model_home(settings: Settings) -> Path:
    return next((settings.cache_dir / "models").iterdir())


def prepared_dir(settings: Settings) -> Path:
    return model_home(settings) / "prepared"


def test_local_source_is_read_in_place_then_fast_resume(local_settings):
    """Cold from a local directory copies nothing: the cache holds the prepared snapshot and nothing else."""
    src = Path(local_settings.model)
    clock = StageClock(300)
    loaded = provision_and_load(local_settings, clock)
    assert [name for name, _ in clock.history] == COLD and loaded.files == src.resolve()
    tensor_bytes = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert tensor_bytes <= clock.detail["bytes"] <= sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert 0 < clock.detail["rss_before_gib"] <= clock.detail["peak_rss_gib"]  # host RAM of the load, reported
    assert not local_settings.cache_dir.exists() or not any(p.is_file() for p in local_settings.cache_dir.rglob("*"))
    plan = loaded.prepare.write(workers=2)
    cached = [p for p in local_settings.cache_dir.rglob("*") if p.is_file()]
    assert {p.parent for p in cached} == {prepared_dir(local_settings)}
    assert sum(p.stat().st_size for p in cached) - (prepared_dir(local_settings) / PLAN_NAME).stat().st_size == \
        sum(plan.files.values())
    assert boot_stages(local_settings) == FAST


def test_changed_local_source_takes_the_cold_path(local_settings):
    boot_stages(local_settings)
    config = Path(local_settings.model) / "generation_config.json"
    config.write_text(config.read_text().replace("0.95", "0.9"))
    assert boot_stages(local_settings) == COLD
    assert boot_stages(local_settings) == FAST


def test_s3_source_lands_in_the_cache_and_is_read_there(s3_settings):
    clock = StageClock(300)
    loaded = provision_and_load(s3_settings, clock)
    assert [name for name, _ in clock.history] == COLD
    snapshot = model_home(s3_settings) / "snapshot"
    assert loaded.files == snapshot and sorted(p.name for p in snapshot.glob("*.safetensors"))
    loaded.prepare.write(workers=2)
    assert boot_stages(s3_settings) == FAST


def test_fast_resume_gives_the_weights_a_cold_start_served(local_settings):
    """The prepared snapshot is written after the engine took the weights (it rebinds fused ones to views and
    splits experts between device slots and its host bank under a budget) and served: expert swaps wait for
    the write (they move experts between the two places); reading it back gives the checkpoint's bytes."""
    half = checkpoint_sizes(Path(local_settings.model), ModelConfig.from_dir(local_settings.model)).experts / 2
    settings = local_settings.model_copy(update={"moe_vram_budget_gib": half / 2 ** 30, "max_num_seqs": 2})
    loaded = provision_and_load(settings, StageClock(300))
    model = build_served_model(loaded, settings)
    offload = model.engine.core.offload
    assert offload is not None and 0 < len(offload.resident[offload.layers[0]]) < offload.num_experts

    def serve_a_little(tag: str) -> None:
        core = model.engine.core
        for i, n in enumerate((9, 30)):
            core.add(Sequence(f"{tag}{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=6, ignore_eos=True)))
        while core.has_work:
            core.step()

    serve_a_little("before")
    assert offload.swaps_held and offload.stats.swaps == 0
    loaded.prepare.write(workers=2)
    offload.swaps_held = False  # what the worker does once the write has ended
    serve_a_little("after")
    assert offload.stats.swaps > 0  # the same traffic moves experts once they may
    back, _ = load_prepared(prepared_dir(settings))
    truth = load_weights(Path(settings.model), loaded.config, "cpu", torch.float32)
    assert back.keys() == truth.keys()
    for name, weight in truth.items():
        a = [weight] if isinstance(weight, torch.Tensor) else [getattr(weight, f) for f in vars(weight)]
        b = [back[name]] if isinstance(back[name], torch.Tensor) else [getattr(back[name], f) for f in vars(weight)]
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def test_truncated_prepared_file_takes_the_cold_path(local_settings):
    boot_stages(local_settings)
    plan = read_plan(prepared_dir(local_settings))
    victim = prepared_dir(local_settings) / next(iter(plan.files))
    victim.write_bytes(victim.read_bytes()[:-4096])
    assert boot_stages(local_settings) == COLD
    assert boot_stages(local_settings) == FAST


def test_wrong_hash_is_repaired(local_settings):
    boot_stages(local_settings)
    plan = read_plan(prepared_dir(local_settings))
    region = plan.regions[-1]
    path = prepared_dir(local_settings) / region.file
    data = bytearray(path.read_bytes())
    data[region.offset + region.size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert boot_stages(local_settings) == FAST + ["repair"] + COLD
    assert boot_stages(local_settings) == FAST


def test_drafts_turned_on_after_a_start_without_them_take_the_cold_path_once(tmp_path, capsys):
    """A prepared snapshot written with drafts off has no MTP layer: a start that drafts goes cold (saying why) and
    writes one with it; a start without drafts then reads that snapshot less the MTP layer (nothing unused in
    memory)."""
    src = write_tiny_model(tmp_path / "src", "nvfp4-ct", num_nextn_predict_layers=1)
    off = Settings(model=str(src), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    on = off.model_copy(update={"mtp_drafts": True})
    assert boot_stages(off) == COLD
    capsys.readouterr()
    clock = StageClock(300)
    loaded = provision_and_load(on, clock)
    assert [name for name, _ in clock.history] == COLD
    cold = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PROVISION_STAGE=cold"))
    assert "without the MTP layer (layer 8) that drafts need" in cold
    assert any(name.startswith("layers.8.") for name in loaded.weights)
    loaded.prepare.write(workers=2)
    for settings in (on, off):
        clock = StageClock(300)
        loaded = provision_and_load(settings, clock)
        assert [name for name, _ in clock.history] == FAST
        assert any(name.startswith("layers.8.") for name in loaded.weights) == settings.mtp_drafts


def test_engine_version_change_takes_the_cold_path(local_settings):
    boot_stages(local_settings)
    plan_path = prepared_dir(local_settings) / PLAN_NAME
    plan = json.loads(plan_path.read_text())
    plan["engine_version"] = "0.0.0-old"
    plan_path.write_text(json.dumps(plan))
    assert boot_stages(local_settings) == COLD


def test_damaged_downloaded_snapshot_is_downloaded_again(s3_settings):
    boot_stages(s3_settings)
    snapshot = model_home(s3_settings) / "snapshot"
    shard = sorted(snapshot.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert boot_stages(s3_settings) == COLD
    assert boot_stages(s3_settings) == FAST


def _boot_process(tmp_path: Path, port: int, *extra: str, code: str | None = None, **env: str) -> subprocess.Popen:
    """`glmflash boot` in a process of its own (`code`: a program to run instead of the plain CLI, given the
    same arguments)."""
    program = ["-c", code] if code else ["-m", "worker.cli"]
    return subprocess.Popen([sys.executable, *program, "boot", "--port", str(port), "--host", "127.0.0.1",
                             "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env}, cwd=Path(__file__).parents[2])


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if requests.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass  # not listening yet, or too busy loading to answer in time
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"not ready in {timeout}s: {proc.stdout.read()}")


def test_sigterm_drains_streaming_request_and_exits_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _boot_process(tmp_path, port, GLMFLASH_DRAIN_GRACE_S="60")
    _wait_ready(proc, url)
    body = {"prompt": "drain me", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        refused = None
        while refused is None and time.monotonic() < deadline:
            answer = requests.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            if answer.status_code == 503:
                refused = answer
        assert refused is not None and refused.json()["error"]["code"] == "not_ready"
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0
    output = proc.stdout.read()
    assert "PROVISION_STAGE=draining" in output and "PROVISION_STAGE=stopped" in output and "reason=signal" in output


def test_a_busy_port_is_one_line_and_exit_1(tmp_path):
    """Another server on the port: one log line naming the address and the way out, no traceback."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _boot_process(tmp_path, port)
        assert proc.wait(timeout=120) == 1
    output = proc.stdout.read()
    assert "Traceback" not in output
    failed = [line for line in output.splitlines() if "event=listen_failed" in line]
    assert len(failed) == 1 and f"port={port}" in failed[0] and "GLMFLASH_PORT" in failed[0]
    assert "address already in use" in failed[0].lower()


def test_boot_seeds_the_volume_with_an_images_prebuilt_kernels(tmp_path):
    """GLMFLASH_PREBUILT_KERNELS (the Docker image sets it): its Triton cache entries are copied into the
    volume's cache before the engine starts, and the log says how many."""
    from engine.kernels.prebuilt import MANIFEST, TRITON

    prebuilt = tmp_path / "image" / "prebuilt-kernels"
    (prebuilt / TRITON / "a-cache-key").mkdir(parents=True)
    (prebuilt / TRITON / "a-cache-key" / "kernel.cubin").write_bytes(b"compiled at build time")
    (prebuilt / MANIFEST).write_text("[]")
    port = free_port()
    volume = tmp_path / "volume-triton"  # explicit: an earlier test of this process may have set it
    proc = _boot_process(tmp_path, port, GLMFLASH_PREBUILT_KERNELS=str(prebuilt), TRITON_CACHE_DIR=str(volume))
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "event=compile_cache" in (output := proc.stdout.read()) and "seeded=1" in output
    assert (volume / "a-cache-key" / "kernel.cubin").read_bytes() == b"compiled at build time"


def test_idle_timeout_parks_and_reports(tmp_path):
    from aiohttp import web
    import asyncio
    import threading

    reports: list[dict] = []

    async def record(request: web.Request) -> web.Response:
        reports.append(await request.json())
        return web.json_response({})

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/report", record)
    runner = web.AppRunner(app)
    controller_port = free_port()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", controller_port).start())
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    port = free_port()
    proc = _boot_process(tmp_path, port, GLMFLASH_IDLE_TIMEOUT_S="2",
                         GLMFLASH_CONTROLLER_URL=f"http://127.0.0.1:{controller_port}/report")
    _wait_ready(proc, f"http://127.0.0.1:{port}")
    assert requests.get(f"http://127.0.0.1:{port}/idle", timeout=5).json()["in_flight"] == 0
    assert proc.wait(timeout=60) == 0
    output = proc.stdout.read()
    assert "PROVISION_STAGE=parking" in output and "reason=idle" in output
    assert reports and reports[-1]["stage"] == "parked" and reports[0]["in_flight"] == 0
    loop.call_soon_threadsafe(loop.stop)


# The CLI with each piece of the prepared snapshot (one a weight, at the tiny model's sizes) checksummed 30 ms
# late: a write that lasts seconds.
SLOW_PREPARE = """
import sys, time
import engine.checkpoint.prepared_store as store
digest = store._digest
def late(view):
    time.sleep(0.03)
    return digest(view)
store._digest = late
from worker.cli import main
main(sys.argv[1:])
"""


def _prepared_state(url: str) -> str | None:
    return requests.get(f"{url}/ready", timeout=5).json().get("prepared_snapshot")


def _wait_journaled(url: str, partial: Path, timeout: float = 60) -> None:
    """Until the background write has journaled pieces (it is still writing)."""
    deadline = time.monotonic() + timeout
    while not ((partial / JOURNAL_NAME).is_file() and (partial / JOURNAL_NAME).read_text().count("\n") > 0):
        state = _prepared_state(url)
        assert time.monotonic() < deadline and state == "writing", state
        time.sleep(0.02)


def _models_home(tmp_path: Path, url: str, timeout: float = 60) -> Path:
    """The model's cache home, made by the background write (which may not have begun yet)."""
    models = tmp_path / "cache" / "models"
    deadline = time.monotonic() + timeout
    while not (models.is_dir() and any(models.iterdir())):
        assert time.monotonic() < deadline and _prepared_state(url) == "writing"
        time.sleep(0.02)
    return next(models.iterdir())


class _Workers:
    """`glmflash boot` processes one after another on one port and cache directory; any still running at the
    end is killed."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.port = tmp_path, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.started: list[subprocess.Popen] = []

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def boot(self, code: str | None = None, **env: str) -> subprocess.Popen:
        """A worker started and ready (`code`: see `_boot_process`)."""
        self.started.append(_boot_process(self.tmp_path, self.port, code=code, **env))
        _wait_ready(self.started[-1], self.url)
        return self.started[-1]

    @staticmethod
    def stopped(proc: subprocess.Popen, timeout: float = 120) -> str:
        """SIGTERM: the worker exits 0 -> what it printed."""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=timeout) == 0
        return proc.stdout.read()


def test_a_stop_during_the_background_prepare_finishes_it_within_the_grace_or_leaves_it_to_resume(tmp_path):
    """SIGTERM while the prepared snapshot is written after ready: with a grace too short the write stops where
    it is (nothing trusted, its pieces kept); the next start is cold, resumes the write from those pieces and,
    stopped at once with a long grace, finishes it before it exits; the start after that is a fast_resume."""
    with _Workers(tmp_path) as workers:
        url = workers.url
        proc = workers.boot(SLOW_PREPARE, GLMFLASH_DRAIN_GRACE_S="0.5")
        prepared = _models_home(tmp_path, url) / "prepared"
        _wait_journaled(url, partial_dir(prepared))
        first = workers.stopped(proc)
        assert "event=prepared_snapshot state=stopped" in first and "next_start=resumes" in first, first
        assert check_prepared(prepared, FORMAT_VERSION, engine_version()) != [] and partial_dir(prepared).is_dir()

        proc = workers.boot(SLOW_PREPARE, GLMFLASH_DRAIN_GRACE_S="60")
        assert _prepared_state(url) == "writing"
        second = workers.stopped(proc)
        assert "PROVISION_STAGE=cold" in second and "event=prepared_snapshot state=resuming" in second, second
        assert "event=prepared_snapshot state=written" in second and "yielded_s=" in second
        assert not partial_dir(prepared).exists()
        assert check_prepared(prepared, FORMAT_VERSION, engine_version()) == []

        third = workers.stopped(workers.boot(GLMFLASH_DRAIN_GRACE_S="60"))
        assert "PROVISION_STAGE=fast_resume" in third and "PROVISION_STAGE=cold" not in third, third


def test_kill_9_during_the_background_prepare_leaves_nothing_trusted(tmp_path):
    """A worker killed (SIGKILL) while it writes its prepared snapshot after ready: the next start does not
    trust the half-written files, starts cold, serves, resumes the write from its journal and ends it whole;
    the one after is a fast_resume."""
    with _Workers(tmp_path) as workers:
        url = workers.url
        proc = workers.boot(SLOW_PREPARE)
        prepared = _models_home(tmp_path, url) / "prepared"
        partial = partial_dir(prepared)
        _wait_journaled(url, partial)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        first = proc.stdout.read()
        assert "PROVISION_STAGE=ready" in first and "state=written" not in first, first
        assert check_prepared(prepared, FORMAT_VERSION, engine_version()) != []

        proc = workers.boot()
        deadline = time.monotonic() + 60
        while (state := _prepared_state(url)) != "written":
            assert time.monotonic() < deadline and state == "writing", state
            time.sleep(0.05)
        second = workers.stopped(proc, timeout=30)
        assert "PROVISION_STAGE=cold" in second and "plan.json: missing" in second, second
        assert "event=prepared_snapshot state=resuming" in second  # from the pieces the killed write journaled
        assert "event=prepared_snapshot state=written" in second and not partial.exists()
        assert check_prepared(prepared, FORMAT_VERSION, engine_version()) == []

        proc = workers.boot()
        assert _prepared_state(url) is None  # nothing to write after a fast resume
        third = workers.stopped(proc, timeout=30)
        assert "PROVISION_STAGE=fast_resume" in third and "PROVISION_STAGE=cold" not in third, third
