"""Real `glmflash` servers for the HTTP tests: `serve()` in a background thread on a free port.

Every server runs the tiny random model on the CPU. The main one (`server`) carries a logits
processor that forces a scripted GLM output (reasoning, content, a tool call) for prompts that
contain a marker word, so the reasoning and tool-call paths can be tested end to end without
touching any other request.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from engine.tiny.factory import write_tiny_model
from server_helpers import ForceScript, Server, make_settings, start_server, stop_server


def _in_flight_after(server: Server, timeout: float = 10.0) -> int:
    """Accepted engine requests left once the tests are done (polled: aborts take an engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _, body = server.get("/idle", timeout=2)
        except OSError:
            return 0  # not serving (it failed or was stopped); reported elsewhere
        in_flight = json.loads(body).get("in_flight", 0) if status == 200 else 0
        if not in_flight or time.monotonic() > deadline:
            return in_flight
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve-tiny") / "tiny", "bf16", 0)


@pytest.fixture(scope="session")
def many_experts(tmp_path_factory) -> Path:
    """For early readiness: 7 MoE layers x 64 experts x 3 projections of 96 x 192 bf16, 15.5 MB of experts, of
    which a short request routes to a few per layer (top 2)."""
    return write_tiny_model(tmp_path_factory.mktemp("partial") / "tiny", "bf16", 0, n_routed_experts=64,
                            num_experts_per_tok=2)


@pytest.fixture(scope="session")
def launch(tmp_path_factory, tiny_model_dir):
    """launch(**settings overrides, logits_processors=..., wait_ready=True) -> Server; all stopped at the end."""
    servers: list[Server] = []

    def _launch(logits_processors: Sequence[Callable] = (), wait_ready: bool = True, **overrides: Any) -> Server:
        settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("serve-cache"), **overrides)
        server = start_server(settings, logits_processors, wait_ready)
        servers.append(server)
        return server

    yield _launch
    errors = []
    for server in servers:
        leaked = _in_flight_after(server)
        if leaked:
            errors.append(f"{server.url}: {leaked} engine requests still in flight after the tests (a leak)")
        try:
            stop_server(server)
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="session")
def force_script() -> ForceScript:
    return ForceScript()


@pytest.fixture(scope="session")
def server(launch, force_script) -> Server:
    """The shared server: 8 slots, default context, the marker-keyed forcing processor."""
    return launch(logits_processors=[force_script])


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def router_key():
    """The Vast router's signing key (vast_helpers signs with it; the stand-in controller serves its public half)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture()
def client(server):
    import openai

    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        yield c
