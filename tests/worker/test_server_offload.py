"""The server with hybrid expert offload: same answers as all-resident, offload figures in /metrics."""

from __future__ import annotations

import openai

from engine.tiny.factory import write_tiny_model
from server_helpers import MODEL_NAME, make_settings, start_server, stop_server


def ask(srv, prompt: str) -> str:
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60) as c:
        return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text


def test_experts_on_the_host_answer_the_same_and_show_in_metrics(launch, server):
    hybrid = launch(moe_vram_budget_gib=0.0)  # every routed expert in host RAM
    for prompt in ("offload me", "a second, longer prompt about experts"):
        assert ask(hybrid, prompt) == ask(server, prompt)
    metrics = hybrid.metrics()
    assert metrics["glmflash_expert_host_pairs"] > 0
    assert metrics["glmflash_expert_device_hit_ratio"] == 0.0
    assert metrics["glmflash_expert_host_gbps"] > 0
    assert server.metrics()["glmflash_expert_device_hit_ratio"] == 1.0


def test_split_misses_answer_the_same_and_show_the_split(tmp_path_factory):
    """GLMFLASH_PCIE_EXPERT_PERCENT on an NVFP4 model (host experts on the compiled CPU kernels): half the
    decode misses take the copy-then-run path, the rest the CPU; answers equal the all-resident server's."""
    model = write_tiny_model(tmp_path_factory.mktemp("split") / "tiny", "nvfp4-ct", 0)
    servers = [start_server(make_settings(model, tmp_path_factory.mktemp("split-cache"), **overrides), ())
               for overrides in ({}, {"moe_vram_budget_gib": 0.0, "pcie_expert_percent": 50})]
    try:
        resident, split = servers
        assert ask(split, "split the misses") == ask(resident, "split the misses")
        metrics = split.metrics()
        assert metrics["glmflash_expert_pcie_percent"] == 50
        assert metrics["glmflash_expert_fetched_pairs"] > 0 and 0 < metrics["glmflash_expert_cpu_share"] < 1
        assert metrics['glmflash_expert_transfer_gbps{path="pcie"}'] > 0  # bytes over the time since start
        assert metrics['glmflash_expert_transfer_gbps{path="cpu"}'] > 0
    finally:
        for server in servers:
            stop_server(server)


def test_calibration_prompts_put_their_hottest_experts_in_slots(tmp_path):
    """GLMFLASH_EXPERT_CALIBRATION: the prompts are prefilled before ready and each layer's device slots end
    up holding experts routed to at least as often as any left on the host."""
    from engine.tiny.factory import NUM_LAYERS, TEXT_CONFIG
    from worker.settings import Settings
    from provision.stages import StageClock
    from worker.provisioning import provision_and_load
    from worker.served_model import build_served_model

    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(f"calibration prompt {i} about routing and experts " * 4 for i in range(6)))
    expert_bytes = 3 * TEXT_CONFIG["hidden_size"] * TEXT_CONFIG["moe_intermediate_size"] * 2  # bf16
    budget_gib = 2.5 * expert_bytes * (NUM_LAYERS - 1) / 2 ** 30  # two slots per MoE layer
    settings = Settings(model=None, device="cpu", dtype="bfloat16", max_model_len=1024, cache_dir=tmp_path / "cache",
                        moe_vram_budget_gib=budget_gib, expert_calibration=calibration, container_id=None,
                        report_addr=None)
    offload = build_served_model(provision_and_load(settings, StageClock(300.0)), settings).engine.core.offload
    assert offload.swaps_held and offload.stats.swaps == 0  # a cold start: the prepared snapshot is written first
    offload.swaps_held = False  # what the end of that write does; the engine's next step rebalances:
    assert offload.rebalance(4) > 4 and offload.stats.swaps > 4  # the calibration's whole placement at once
    counts = offload.counts
    for layer in offload.layers:
        resident, hosted = offload.resident[layer], [e for e in offload.hosted[layer] if e is not None]
        assert len(resident) == 2
        row = counts[offload.layers.index(layer)]
        assert row[resident].min() >= row[hosted].max()
