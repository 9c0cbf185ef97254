"""The server with hybrid expert offload: same answers as all-resident, offload figures in /metrics."""

from __future__ import annotations

import openai

from server_helpers import MODEL_NAME


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
