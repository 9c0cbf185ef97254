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
    finally:
        for server in servers:
            stop_server(server)
