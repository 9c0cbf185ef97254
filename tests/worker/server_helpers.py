"""Helpers for the HTTP tests: a real `serve()` in a background thread, the forcing processor, SSE reading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch

from engine.tiny.tokenizer import TOKEN_IDS
from worker.settings import Settings
from worker.serve import serve

READY_TIMEOUT_S = 60.0
MODEL_NAME = "tiny-test"

# --- the forced output ----------------------------------------------------------------------------

FORCE_MARKER = "FORCETOOLS"  # a user message containing this gets the scripted answer
FAIL_MARKER = "FAILSTEP"  # a prompt containing this makes the processor raise (an engine step failure)
FAIL_MESSAGE = "scripted processor failure"
ASSISTANT, THINK, END_THINK, EOS = TOKEN_IDS["<|assistant|>"], TOKEN_IDS["<think>"], TOKEN_IDS["</think>"], 256


def _text(s: str) -> list[int]:
    return list(s.encode())


def _tag(name: str) -> list[int]:
    return [TOKEN_IDS[name]]


REASONING_TEXT = "I think."
CONTENT_TEXT = "Sure."
TOOL_CALL_IDS = (
    _tag("<tool_call>") + _text("get_weather")
    + _tag("<arg_key>") + _text("city") + _tag("</arg_key>") + _tag("<arg_value>") + _text("Paris") + _tag("</arg_value>")
    + _tag("<arg_key>") + _text("days") + _tag("</arg_key>") + _tag("<arg_value>") + _text("3") + _tag("</arg_value>")
    + _tag("</tool_call>")
)
# Thinking on (prompt ends with <|assistant|><think>): reasoning, </think>, content, the call, eos.
SCRIPT_THINKING = _text(REASONING_TEXT) + [END_THINK] + _text(CONTENT_TEXT) + TOOL_CALL_IDS + [EOS]
# Thinking off (prompt ends with <|assistant|></think>): the same without the reasoning part.
SCRIPT_PLAIN = _text(CONTENT_TEXT) + TOOL_CALL_IDS + [EOS]


def _contains(ids: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    return any(list(ids[i:i + n]) == list(needle) for i in range(len(ids) - n + 1))


class ForceScript:
    """Logits processor: for prompts containing FORCE_MARKER, force SCRIPT_THINKING / SCRIPT_PLAIN.

    A prompt containing FAIL_MARKER makes it raise instead, which fails the engine step.

    The output starts after the last `<|assistant|>` and the think tag the template put after it;
    the script never contains `<|assistant|>`, so the position in the script is unambiguous.
    """

    def __init__(self) -> None:
        self.marker, self.fail_marker = _text(FORCE_MARKER), _text(FAIL_MARKER)
        self.calls = 0

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if _contains(token_ids, self.fail_marker):
            raise RuntimeError(FAIL_MESSAGE)
        if ASSISTANT not in token_ids or not _contains(token_ids, self.marker):
            return logits  # not a chat prompt with the marker
        self.calls += 1
        start = len(token_ids) - 1 - token_ids[::-1].index(ASSISTANT)
        opener = token_ids[start + 1] if start + 1 < len(token_ids) else None
        script = SCRIPT_THINKING if opener == THINK else SCRIPT_PLAIN
        position = len(token_ids) - (start + 2)
        target = script[position] if position < len(script) else EOS
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced


# --- servers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    settings: Settings
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None
    stop: asyncio.Event | None = None
    error: BaseException | None = None
    trace: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a plain GET, errors included."""
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def post(self, path: str, body: bytes | dict, headers: dict[str, str] | None = None,
             timeout: float = 60.0) -> tuple[int, dict, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from GET /metrics."""
        from worker.metrics import samples

        status, _, body = self.get("/metrics")
        assert status == 200
        return samples(body.decode())

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def check_alive(self) -> None:
        if self.error is not None:
            pytest.fail(f"the server thread died: {self.error!r}\n{self.trace}")
        assert self.thread is not None and self.thread.is_alive(), "the server thread is not running"


def make_settings(model_dir: Path | None, cache_dir: Path, **overrides: Any) -> Settings:
    fields: dict[str, Any] = dict(
        model=None if model_dir is None else str(model_dir), served_model_name=MODEL_NAME, host="127.0.0.1", port=free_port(),
        device="cpu", dtype="float32", cache_dir=cache_dir, max_num_seqs=8, max_queue=256,
        max_model_len=8192, api_key=None, hf_token=None, log_level="WARNING",
        # no parking, no controller, a short drain: the environment must not change how a test server lives
        idle_timeout_s=0.0, controller_url=None, drain_grace_s=5.0,
    )
    fields.update(overrides)
    return Settings(**fields)


def start_server(settings: Settings, logits_processors: Sequence[Callable] = (), wait_ready: bool = True) -> Server:
    server = Server(url=f"http://{settings.host}:{settings.port}", settings=settings)
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        server.loop = loop

        async def main() -> None:
            server.stop = asyncio.Event()
            started.set()
            await serve(settings, server.stop, logits_processors=logits_processors)

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported by the fixture / check_alive
            server.error, server.trace = exc, traceback.format_exc()
        finally:
            started.set()
            loop.close()

    server.thread = threading.Thread(target=run, name=f"glmflash-test-server-{settings.port}", daemon=True)
    server.thread.start()
    started.wait(10)
    if wait_ready:
        wait_ready_or_fail(server)
    return server


def wait_ready_or_fail(server: Server, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if server.error is not None or not server.thread.is_alive():
            pytest.fail(f"the server exited before it was ready: {server.error!r}\n{server.trace}")
        try:
            status, _, body = server.get("/ready", timeout=2)
            last = (status, body)
            if status == 200:
                return
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.05)
    stop_server(server)
    pytest.fail(f"the server was not ready after {timeout}s; last /ready answer: {last!r}\n{server.trace}")


def stop_server(server: Server, timeout: float = 30.0) -> None:
    if server.loop is not None and server.stop is not None and not server.loop.is_closed():
        try:
            server.loop.call_soon_threadsafe(server.stop.set)
        except RuntimeError:  # the loop closed in between
            pass
    if server.thread is not None:
        server.thread.join(timeout)
        assert not server.thread.is_alive(), "the server did not stop"
    if server.error is not None:
        raise AssertionError(f"the server failed: {server.error!r}\n{server.trace}")




# --- polling, raw SSE, sanity ---------------------------------------------------------------------


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until predicate() is truthy; its value, or fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


async def read_sse(response) -> list[str]:
    """The `data:` payloads of an aiohttp SSE response, in order (checks the event framing too)."""
    events, buffer = [], b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            line = event.decode()
            assert line.startswith("data: "), f"not an SSE data event: {line!r}"
            events.append(line[len("data: "):])
    assert buffer == b"", f"trailing bytes after the last event: {buffer!r}"
    return events


async def raw_stream(url: str, body: dict, headers: dict[str, str] | None = None,
                     timeout: float = 60.0) -> tuple[int, dict, list[str]]:
    """POST a streaming request with plain aiohttp: (status, headers, data payloads)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(url, json=body, headers=headers or {}) as response:
            if response.status != 200:
                return response.status, dict(response.headers), [await response.text()]
            return response.status, dict(response.headers), await read_sse(response)


def assert_serves(server: Server, headers: dict[str, str] | None = None) -> None:
    """The server still answers a good request (after a bad one, a disconnect, an overload)."""
    server.check_alive()
    status, _, body = server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2, "temperature": 0,
                                                     "ignore_eos": True}, headers=headers)
    assert status == 200, body
    payload = json.loads(body)
    assert payload["usage"]["completion_tokens"] == 2


def assert_error_body(body: bytes, status: int, param: str | None = ..., code: str | None = ...) -> dict:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}, all four keys present."""
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error
