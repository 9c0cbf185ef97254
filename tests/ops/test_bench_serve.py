"""ops/bench_serve.py against a minimal OpenAI streaming stand-in served on a free local port."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "bench_serve.py"
_spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_serve"] = bench  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(bench)

DELAY = 0.02  # seconds before each generated chunk


def stand_in(chunks: int = 4, tokens_per_chunk: int = 1, fail_every: int = 0, usage: bool = True,
             done: bool = True, cached: int | None = None) -> tuple[web.Application, list[dict[str, Any]]]:
    """OpenAI streaming stand-in: a role-only chat chunk, `chunks` text chunks DELAY apart, usage (with
    `cached` as prompt_tokens_details.cached_tokens when given), [DONE]."""
    bodies: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        if fail_every and len(bodies) % fail_every == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(chunks):
            await asyncio.sleep(DELAY)
            delta = {"reasoning_content": "hm"} if i == 0 else {"content": f" w{i}"}
            await send({"choices": [{"index": 0, "delta": delta} if chat else {"index": 0, "text": f" w{i}"}]})
        if usage:
            details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": chunks * tokens_per_chunk,
                                                 **details}})
        if done:
            await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app, bodies


@contextmanager
def serve(app: web.Application) -> Iterator[str]:
    """Serves app from a background event loop on a free port; yields its /v1 base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def run_cli(app: web.Application, tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    with serve(app) as base_url:
        rc = bench.main(["--base-url", base_url, "--prompt-tokens", "16", "--json", str(out), *argv])
    return rc, json.loads(out.read_text())


def test_chat_levels_counts_tokens_and_timing(tmp_path: Path, capsys) -> None:
    app, bodies = stand_in(chunks=4)
    rc, report = run_cli(app, tmp_path, "--concurrency", "1,3", "--max-tokens", "4", "--ignore-eos")
    assert rc == 0 and report["model"] == "stand-in"
    assert [(lvl["level"], lvl["requests"], lvl["ok"], lvl["failed"]) for lvl in report["levels"]] == [
        (1, 8, 8, 0), (3, 12, 12, 0)]
    for lvl in report["levels"]:
        assert lvl["output_tokens"] == 4 * lvl["requests"]
        assert lvl["usage_missing"] == 0 and lvl["below_max_tokens"] == 0 and lvl["prompt_tokens_mean"] == 7
        assert DELAY * 1000 * 0.8 <= lvl["ttft_p50_ms"] < lvl["e2e_p50_ms"]  # the role-only chunk is not text
        assert DELAY * 1000 * 0.8 <= lvl["itl_p50_ms"] <= DELAY * 1000 * 2.5
        assert lvl["output_tok_s"] > 0 and lvl["req_s"] > 0
    assert report["levels"][1]["wall_s"] < report["levels"][0]["wall_s"]  # 3 in flight beats 1
    first = bodies[0]
    assert first["stream"] and first["stream_options"] == {"include_usage": True} and first["ignore_eos"] is True
    assert first["messages"][0]["content"] != bodies[1]["messages"][0]["content"]  # no shared prefix to cache
    assert len(first["messages"][0]["content"].split()) == 16

    out = capsys.readouterr().out
    assert out.startswith("# python ops/bench_serve.py --base-url http://127.0.0.1:")
    kv = [dict(f.split("=", 1) for f in line.split()) for line in out.splitlines() if line.startswith("level=")]
    assert [d["level"] for d in kv] == ["1", "3"] and kv[1]["ok"] == "12" and kv[1]["output_tokens"] == "48"
    assert {"ttft_p99_ms", "itl_p90_ms", "e2e_p50_ms", "output_tok_s", "req_s"} <= kv[0].keys()
    assert any(line.startswith("bench url=") and "model=stand-in" in line for line in out.splitlines())


def test_completions_multi_token_chunks_divide_itl(tmp_path: Path) -> None:
    app, bodies = stand_in(chunks=4, tokens_per_chunk=2)
    rc, report = run_cli(app, tmp_path, "--endpoint", "completions", "--concurrency", "2", "--max-tokens", "8")
    (lvl,) = report["levels"]
    assert rc == 0 and lvl["ok"] == 8 and lvl["output_tokens"] == 64
    assert DELAY * 1000 * 0.4 <= lvl["itl_p50_ms"] <= DELAY * 1000 * 1.25  # 2 tokens per chunk
    assert "prompt" in bodies[0] and "ignore_eos" not in bodies[0]


def test_missing_usage_falls_back_to_chunk_count(tmp_path: Path, capsys) -> None:
    app, _ = stand_in(chunks=3, usage=False)
    rc, report = run_cli(app, tmp_path, "--concurrency", "1", "--max-tokens", "5", "--ignore-eos")
    (lvl,) = report["levels"]
    assert rc == 0 and lvl["ok"] == 8 and lvl["output_tokens"] == 24 and lvl["usage_missing"] == 8
    assert lvl["below_max_tokens"] == 8
    out = capsys.readouterr().out
    assert "tokens counted as chunks" in out and "ignore ignore_eos" in out


def test_server_errors_are_failures_not_crashes(tmp_path: Path, capsys) -> None:
    app, _ = stand_in(chunks=2, fail_every=3)
    rc, report = run_cli(app, tmp_path, "--concurrency", "3", "--max-tokens", "2")
    (lvl,) = report["levels"]
    assert rc == 1 and (lvl["requests"], lvl["ok"], lvl["failed"]) == (12, 8, 4)
    assert lvl["output_tokens"] == 16 and lvl["errors"] == {'HTTP 500: {"error": {"message": "boom"}}': 4}
    assert "4x HTTP 500" in capsys.readouterr().out


def test_stream_without_done_is_a_failure(tmp_path: Path) -> None:
    app, _ = stand_in(chunks=2, done=False)
    rc, report = run_cli(app, tmp_path, "--concurrency", "2", "--requests-per-level", "3", "--model", "m")
    (lvl,) = report["levels"]
    assert rc == 1 and (lvl["ok"], lvl["failed"]) == (0, 3) and lvl["ttft_p50_ms"] is None
    assert lvl["errors"] == {"stream ended without [DONE]": 3} and report["model"] == "m"


def test_agent_workload_sends_growing_histories_and_counts_computed_tokens(tmp_path: Path, capsys) -> None:
    app, bodies = stand_in(chunks=3, cached=5)
    out = tmp_path / "agent.json"
    with serve(app) as base_url:
        rc = bench.main(["--base-url", base_url, "--workload", "agent", "--conversations", "3", "--turns", "2",
                         "--system-tokens", "30", "--user-tokens", "4", "--max-tokens", "3", "--json", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert rc == 0 and (run["requests"], run["ok"]) == (6, 6)
    assert (run["prompt_tokens"], run["cached_tokens"], run["prefill_tokens_computed"]) == (42, 30, 12)
    assert run["ttft_first_turn_p50_ms"] is not None and run["ttft_later_turns_p50_ms"] is not None
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and len(systems.pop().split()) == 30  # one system prompt shared by all
    assert all(b["tools"] and b["temperature"] == 0 for b in bodies)
    second = [b["messages"] for b in bodies if len(b["messages"]) == 4]
    assert len(second) == 3 and all(m[2] == {"role": "assistant", "content": " w1 w2"} for m in second)
    assert "computed_fraction=0.2857" in capsys.readouterr().out
    assert run["engine_prefill_mean_ms"] is None and run["decode_steps"] is None  # no glmflash /metrics there


def test_agent_workload_starts_glmflash_with_the_cache_on_and_off(tmp_path: Path, capsys) -> None:
    out = tmp_path / "agent.json"
    rc = bench.main(["--workload", "agent", "--serve", "tiny", "--device", "cpu", "--conversations", "2",
                     "--turns", "2", "--system-tokens", "40", "--user-tokens", "3", "--max-tokens", "2",
                     "--serve-env", f"GLMFLASH_CACHE_DIR={tmp_path / 'cache'}", "--server-log", str(tmp_path / "logs"),
                     "--json", str(out)])
    report = json.loads(out.read_text())  # its settings hold a path: written as a string
    on, off = report["runs"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["serve-cache-off.log", "serve-cache-on.log"]
    assert rc == 0 and (on["run"], off["run"]) == ("cache_on", "cache_off") and on["ok"] == off["ok"] == 4
    assert on["prompt_tokens"] == off["prompt_tokens"]  # the same conversations (greedy answers, same histories)
    # Each second turn restores its first turn's prompt (less its last token): about half of all prompt tokens.
    assert off["cached_tokens"] == 0 and on["cached_tokens"] > on["prompt_tokens"] * 0.4
    assert report["computed_drop"] > 0.4
    for run in (on, off):  # where TTFT went, from the server's /metrics over the run
        assert 0 <= run["engine_queue_mean_ms"] and 0 < run["engine_prefill_mean_ms"] <= run["ttft_mean_ms"]
        # A request's second token runs in a decode step unless another request's prefill chunk takes it along
        # (then that step counts as prefill): the run's last request always has a decode step of its own.
        assert run["prefill_steps"] >= 1 and run["decode_steps"] >= 1
        assert run["prefill_step_mean_ms"] > 0 and run["decode_step_mean_ms"] > 0
    assert "compare computed_drop=" in capsys.readouterr().out


def test_agent_report_when_every_cache_off_request_failed(tmp_path: Path, monkeypatch, capsys) -> None:
    apps = {True: stand_in(chunks=2, cached=5)[0], False: stand_in(fail_every=1)[0]}

    @contextmanager
    def started(args, prefix_cache: bool) -> Iterator[str]:  # stand-ins for the two glmflash servers
        with serve(apps[prefix_cache]) as base_url:
            yield base_url

    monkeypatch.setattr(bench, "started_server", started)
    out = tmp_path / "agent.json"
    rc = bench.main(["--workload", "agent", "--serve", "tiny", "--conversations", "2", "--turns", "1",
                     "--system-tokens", "5", "--json", str(out)])
    on, off = json.loads(out.read_text())["runs"]
    assert rc == 1 and (on["ok"], off["failed"], off["prefill_tokens_computed"]) == (2, 2, 0)
    printed = capsys.readouterr().out
    assert printed.startswith("# measured run=cache_on") and "compare computed_drop" not in printed


def test_random_workload_starts_glmflash_once(tmp_path: Path) -> None:
    """`--serve` with the random workload: one glmflash started, the levels run against it, the prompts' usage
    counted (long prompts through HTTP: TTFT and decode)."""
    out = tmp_path / "long.json"
    rc = bench.main(["--serve", "tiny", "--device", "cpu", "--concurrency", "1", "--requests-per-level", "2",
                     "--prompt-tokens", "300", "--max-tokens", "4", "--endpoint", "completions", "--ignore-eos",
                     "--serve-env", f"GLMFLASH_CACHE_DIR={tmp_path / 'cache'}", "--server-log", str(tmp_path / "logs"),
                     "--json", str(out)])
    report = json.loads(out.read_text())
    (level,) = report["levels"]
    assert rc == 0 and level["ok"] == 2 and level["failed"] == 0
    assert level["output_tokens"] == 8 and level["ttft_p50_ms"] > 0 and level["prompt_tokens_mean"] > 300
    assert report["url"].startswith("http://127.0.0.1:")
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["serve-cache-on.log"]
