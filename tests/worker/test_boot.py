"""Boot: the cheapest valid start path is taken (cold, fast_resume, repair), SIGTERM drains, idle parks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from engine.tiny.factory import write_tiny_model
from engine.checkpoint.prepared_store import PLAN_NAME, read_plan
from provision.settings import Settings
from provision.stages import StageClock
from server_helpers import free_port
from worker.provisioning import provision_and_load


def boot_stages(settings: Settings) -> list[str]:
    clock = StageClock(300)
    loaded = provision_and_load(settings, clock)
    assert loaded.weights and loaded.config.num_layers == 8
    return [name for name, _ in clock.history]


COLD = ["cold", "download", "verify", "prepare", "load"]
FAST = ["fast_resume", "load"]


@pytest.fixture()
def local_settings(tmp_path) -> Settings:
    src = write_tiny_model(tmp_path / "src", "nvfp4-ct")
    return Settings(model=str(src), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")


def prepared_dir(settings: Settings) -> Path:
    return next((settings.cache_dir / "models").iterdir()) / "prepared"


def test_local_source_cold_then_fast_resume(local_settings):
    assert boot_stages(local_settings) == COLD
    assert boot_stages(local_settings) == FAST


def test_s3_source_cold_then_fast_resume(tmp_path, s3, moto_endpoint):
    src = write_tiny_model(tmp_path / "src", "nvfp4-modelopt")
    s3.create_bucket(Bucket="models")
    for path in src.iterdir():
        s3.upload_file(str(path), "models", f"glm/tiny/{path.name}")
    settings = Settings(s3_uri="s3://models/glm/tiny", s3_endpoint_url=moto_endpoint, cache_dir=tmp_path / "cache",
                        device="cpu", dtype="float32")
    assert boot_stages(settings) == COLD
    assert boot_stages(settings) == FAST


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


def test_engine_version_change_takes_the_cold_path(local_settings):
    boot_stages(local_settings)
    plan_path = prepared_dir(local_settings) / PLAN_NAME
    plan = json.loads(plan_path.read_text())
    plan["engine_version"] = "0.0.0-old"
    plan_path.write_text(json.dumps(plan))
    assert boot_stages(local_settings) == COLD


def test_damaged_original_snapshot_is_downloaded_again(local_settings):
    boot_stages(local_settings)
    snapshot = prepared_dir(local_settings).parent / "snapshot"
    shard = sorted(snapshot.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert boot_stages(local_settings) == COLD


def _boot_process(tmp_path: Path, port: int, *extra: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker.cli", "boot", "--port", str(port), "--host", "127.0.0.1",
                             "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env}, cwd=Path(__file__).parents[2])


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if requests.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
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
