"""Early readiness under Vast, end to end: the real server (`serve()`, the many-experts tiny model, CPU) in Vast mode
on its own port, the stand-in controller (vast_helpers), requests routed and signed through the vastai package's
own client, and a throttled expert fill (GLMFLASH_EXPERT_FILL_GBPS) slow enough to watch.

With no benchmark figure cached, `loaded` waits for the fill and the benchmark; that start caches the figure, and a
later start reports `loaded` at ready with it scaled by the share of expert bytes in place, then the full figure.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from openai.types import Completion

from server_helpers import MODEL_NAME, Server, free_port, make_settings, start_server, stop_server
from vast_helpers import CONTAINER_ID, MTOKEN, Controller, vast_client
from worker.partial_ready import MIN_SHARE
from worker.settings import Settings
from worker.vast import workload_of

FILL_GBPS = 0.004  # the 15.5 MB of experts (conftest.many_experts) in about 4 s
BENCHMARK_S = 2.0
PAYLOAD = {"model": MODEL_NAME, "prompt": "Hi from Vast", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def experts_loaded(server: Server) -> float:
    status, _, body = server.get("/ready")
    assert status == 200, body
    return json.loads(body)["experts_loaded"]


def test_vast_hears_the_reduced_max_perf_while_the_experts_fill(router_key, many_experts, tmp_path, monkeypatch):
    monkeypatch.delenv("USE_SSL", raising=False)
    servers: list[Server] = []

    def vast_settings(ctl: Controller, cache_dir: Path) -> Settings:
        port = free_port()
        monkeypatch.setenv(f"VAST_TCP_PORT_{port}", str(port))  # read by VastConfig.from_settings
        return make_settings(many_experts, cache_dir, port=port, max_num_seqs=4, ready_at="partial",
                             expert_fill_gbps=FILL_GBPS, vast_benchmark_s=BENCHMARK_S,
                             container_id=str(CONTAINER_ID), report_addr=ctl.url, master_token=MTOKEN,
                             public_ipaddr="127.0.0.1", unsecured=False)

    async def boot(ctl: Controller, cache_dir: Path) -> Server:
        server = await asyncio.to_thread(start_server, vast_settings(ctl, cache_dir))
        servers.append(server)
        return server

    async def main() -> tuple[float, float, float]:
        # --- no figure cached: ready (and serving) at once, but "loaded" only after the fill and the benchmark -----
        first = tmp_path / "first"
        async with Controller(router_key) as ctl:
            server = await boot(ctl, first)
            assert 0 < experts_loaded(server) < 1
            assert ctl.statuses and all(s["loadtime"] == 0 for s in ctl.statuses)  # "loading" only
            loaded = await ctl.wait_status(lambda s: s["loadtime"] > 0, timeout=60)
            assert experts_loaded(server) == 1.0
            full = json.loads((first / "vast_benchmark.json").read_text())["max_perf"]
            assert loaded["max_perf"] == full > 0 and loaded["error_msg"] == ""
            await asyncio.to_thread(stop_server, server)

        # --- a later start that kept the figure: the reduced figure at ready, a request served, then the full one ---
        # Only the figure is carried over: read back from a prepared snapshot, this small model's experts would all
        # be in after the warm-up (a 64 MiB piece holds a whole layer's projection), leaving nothing to reduce for.
        second = tmp_path / "second"
        second.mkdir()
        shutil.copy(first / "vast_benchmark.json", second)
        async with Controller(router_key) as ctl:
            server = await boot(ctl, second)
            share = experts_loaded(server)  # read after max_perf was computed: at least the share it saw
            reduced = (await ctl.wait_status(lambda s: s["loadtime"] > 0, timeout=5))["max_perf"]
            # /ready rounds the share to 4 places: it may show a hair less than the share max_perf was scaled by.
            assert full * MIN_SHARE <= reduced <= full * max(share + 1e-4, MIN_SHARE) and reduced < full

            client, endpoint = vast_client(ctl)
            try:
                result = await endpoint.request("/v1/completions", PAYLOAD, cost=workload_of(PAYLOAD))
            finally:
                await client.close()
            assert result["ok"] and result["status"] == 200 and result["url"] == server.url, result
            assert Completion.model_validate(result["response"]).usage.completion_tokens == 4
            assert experts_loaded(server) < 1  # served before the fill completed

            await ctl.wait_status(lambda s: s["max_perf"] == full, timeout=60)
            assert experts_loaded(server) == 1.0
            reported = [s["max_perf"] for s in ctl.statuses if s["loadtime"] > 0]
            assert reported == sorted(reported) and set(reported) == {reduced, full}, reported
            assert all(s["error_msg"] == "" for s in ctl.statuses)
            await asyncio.to_thread(stop_server, server)
        return share, reduced, full

    try:
        share, reduced, full = asyncio.run(main())
    finally:
        for server in servers:
            if server.thread is not None and server.thread.is_alive():
                stop_server(server)
    print(f"max_perf {reduced:.1f} at ready (experts_loaded {share:.3f} soon after), {full:.1f} once filled")
