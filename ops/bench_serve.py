"""Serving benchmark for any OpenAI-compatible server (glmflash, vLLM, SGLang), for side-by-side numbers.

For each concurrency level C it sends N streaming requests with at most C in flight and parses the raw
SSE stream, so it times exactly what arrives on the wire:
  - TTFT: request sent -> first chunk carrying generated text (chat: non-empty content, reasoning_content
    or tool_calls; completions: non-empty text);
  - ITL: gaps between successive text-bearing chunks, divided by the chunk's tokens when the server sends
    usage with every chunk, else by the request's mean tokens per chunk (final usage), else per chunk;
  - E2E latency; completion tokens from the final usage chunk (text chunks counted when the server sends
    no usage, reported as usage_missing);
  - failures: non-200, broken streams, error events, missing [DONE], no generated text.
Per level: ok/failed, TTFT and ITL mean/p50/p90/p99 (ITL pooled over all chunks of the level), E2E p50,
output tokens/s (sum of completion tokens / level wall time) and ok requests/s, printed as a table and as
one key=value line per level, after a `bench ...` line and a comment holding the exact command.
Each request gets its own seeded random word prompt (~1 token per word), so prefix caches do not help.

`--workload agent` is the multi-turn agent workload instead: C conversations at once (`--conversations`),
each `--turns` chat turns over one shared system prompt of `--system-tokens` random words plus tool
definitions; every turn sends the whole history (the previous answers included) and a new user message
of `--user-tokens` words. It reports TTFT p50/p90 over all turns and prefill tokens computed (prompt
tokens less the cached ones, from each response's usage.prompt_tokens_details.cached_tokens), and from a
glmflash server's /metrics where its TTFT went: mean time queued and prefilling per request, steps run
and their mean wall time by kind. With
`--serve MODEL` (a snapshot, or `tiny` for the embedded tiny model) it starts glmflash itself on
`--device`, once with the prefix cache on and once off (each run's line printed as it ends), and compares
the two runs; with the random workload, once (e.g. TTFT and decode of long prompts through HTTP).
Exit status 1 when any request failed.

    python ops/bench_serve.py --base-url http://127.0.0.1:3000/v1 --concurrency 1,4,16 --ignore-eos
    python ops/bench_serve.py --base-url http://gpu:8000/v1 --model zai-org/GLM-5.3-Flash --json vllm.json
    python ops/bench_serve.py --workload agent --serve /models/glm --device cuda --json agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import aiohttp

from worker.metrics import samples

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work number night point home water "
         "room mother area money story fact month lot right study book eye job word business issue side kind "
         "head house service friend father power hour game line end member law car city name team minute idea "
         "body back parent face level office door health person art war history party result change morning "
         "reason research girl moment air teacher force education").split()
STAT_FIELDS = ("mean", "p50", "p90", "p99")


class StreamError(Exception):
    """The stream carried something other than OpenAI chunks (an error event, a non-object payload)."""


@dataclass
class StreamTrace:
    """What one response stream delivered."""
    text_times: list[float] = field(default_factory=list)  # arrival of each text-bearing chunk
    chunk_tokens: list[int | None] = field(default_factory=list)  # per text chunk, when usage came with it
    completion_tokens: int | None = None  # last usage seen
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False
    content: str = ""  # the generated answer text (chat content / completion text)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    content: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:3000/v1")
    p.add_argument("--model", help="default: first id from GET {base-url}/models")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--requests-per-level", type=int, help="default: max(8, 4 * concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="approximate: that many random words")
    p.add_argument("--prompt-file", help="use this file's text as every prompt instead")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--ignore-eos", action="store_true", help="send vendor field ignore_eos: true")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--json", dest="json_out", metavar="OUT.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the random word prompts")
    agent = p.add_argument_group("agent workload")
    agent.add_argument("--workload", choices=("random", "agent"), default="random")
    agent.add_argument("--conversations", type=int, default=8, help="conversations at once")
    agent.add_argument("--turns", type=int, default=8, help="chat turns per conversation")
    agent.add_argument("--system-tokens", type=int, default=2000, help="approximate: random words of the system prompt")
    agent.add_argument("--user-tokens", type=int, default=40, help="approximate: random words per user message")
    serve = p.add_argument_group("starting glmflash (the agent workload: cache on and off)")
    serve.add_argument("--serve", metavar="MODEL", help="snapshot directory / model id, or 'tiny'; replaces --base-url")
    serve.add_argument("--device", default="cpu", help="cuda or cpu, for the started server")
    serve.add_argument("--dtype", help="passed to glmflash serve (default: its own)")
    serve.add_argument("--max-num-seqs", type=int, help="passed to glmflash serve")
    serve.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                       help="more settings for the started server, e.g. GLMFLASH_PREFIX_CACHE_GIB=8")
    serve.add_argument("--ready-timeout", type=float, default=900.0)
    serve.add_argument("--server-log", type=Path, metavar="DIR", help="keep each started server's output (at INFO) "
                       "in DIR/serve-cache-on.log and serve-cache-off.log")
    args = p.parse_args(argv)
    if not (args.base_url or args.serve):
        p.error("one of --base-url or --serve is required")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.command = shlex.join(["python", "ops/bench_serve.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def make_prompts(args: argparse.Namespace, count: int, rng: random.Random) -> list[str]:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return [f.read()] * count
    return [" ".join(rng.choices(WORDS, k=args.prompt_tokens)) for _ in range(count)]


def request_body(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def iter_sse(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) per SSE event, dispatched at the blank line that ends it."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield time.perf_counter(), "\n".join(data)
            data = []
    if data:
        yield time.perf_counter(), "\n".join(data)


def has_text(choice: dict[str, Any], endpoint: str) -> bool:
    if endpoint == "completions":
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))


def answer_text(choice: dict[str, Any], endpoint: str) -> str:
    """The answer text a chunk's choice adds (chat: content only, as a client keeps it in the history)."""
    return (choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")) or ""


async def read_stream(resp: aiohttp.ClientResponse, endpoint: str) -> StreamTrace:
    trace = StreamTrace()
    async for arrived, data in iter_sse(resp):
        if data.strip() == "[DONE]":
            trace.done = True
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict) or chunk.get("error"):
            raise StreamError(f"unexpected event: {data[:200]}")
        usage = chunk.get("usage") or {}
        reported, previous = usage.get("completion_tokens"), trace.completion_tokens or 0
        if reported is not None:
            trace.completion_tokens, trace.prompt_tokens = reported, usage.get("prompt_tokens")
            trace.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        trace.content += "".join(answer_text(c, endpoint) for c in chunk.get("choices") or [])
        if any(has_text(c, endpoint) for c in chunk.get("choices") or []):
            trace.text_times.append(arrived)
            trace.chunk_tokens.append(None if reported is None else reported - previous)
    return trace


def summarize(trace: StreamTrace, start: float, end: float) -> RequestResult:
    if not trace.done:
        return RequestResult(ok=False, error="stream ended without [DONE]")
    if not trace.text_times:
        return RequestResult(ok=False, error="no generated text")
    times, n = trace.text_times, len(trace.text_times)
    tokens = n if trace.completion_tokens is None else trace.completion_tokens
    per_chunk = trace.chunk_tokens if None not in trace.chunk_tokens else [tokens / n] * n
    itl = [(b - a) / k for a, b, k in zip(times, times[1:], per_chunk[1:]) if k > 0]
    return RequestResult(ok=True, ttft_s=times[0] - start, e2e_s=end - start, itl_s=itl,
                         completion_tokens=tokens, prompt_tokens=trace.prompt_tokens, cached_tokens=trace.cached_tokens,
                         usage_reported=trace.completion_tokens is not None, content=trace.content)


async def send_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], endpoint: str) -> RequestResult:
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return RequestResult(ok=False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            trace = await read_stream(resp, endpoint)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, StreamError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    return summarize(trace, start, time.perf_counter())


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"{name}_{s}_ms": None for s in STAT_FIELDS}
    values = {"mean": sum(seconds) / len(seconds), **{f"p{q}": percentile(seconds, q) for q in (50, 90, 99)}}
    return {f"{name}_{s}_ms": round(values[s] * 1000, 2) for s in STAT_FIELDS}


def level_stats(concurrency: int, results: list[RequestResult], wall_s: float, max_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "level": concurrency, "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        **ms_stats("ttft", [r.ttft_s for r in ok]),
        **ms_stats("itl", [x for r in ok for x in r.itl_s]),
        "e2e_p50_ms": round(percentile([r.e2e_s for r in ok], 50) * 1000, 2) if ok else None,
        "output_tokens": tokens, "output_tok_s": round(tokens / wall_s, 2), "req_s": round(len(ok) / wall_s, 3),
        "wall_s": round(wall_s, 3), "prompt_tokens_mean": round(sum(prompt) / len(prompt), 1) if prompt else None,
        "usage_missing": sum(not r.usage_reported for r in ok),
        "below_max_tokens": sum(r.completion_tokens < max_tokens for r in ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
    }


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(f"{base_url}/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError, TypeError) as exc:
        raise SystemExit(f"cannot read a model id from {base_url}/models ({exc}); pass --model") from exc


async def run_level(session: aiohttp.ClientSession, args: argparse.Namespace, model: str, concurrency: int,
                    prompts: list[str]) -> dict[str, Any]:
    url = f"{args.base_url.rstrip('/')}/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str) -> RequestResult:
        async with gate:
            return await send_request(session, url, request_body(args, model, prompt), args.endpoint)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    return level_stats(concurrency, list(results), time.perf_counter() - start, args.max_tokens)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every level in order; the report records the command, resolved model and settings."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        model = args.model or await first_model(session, args.base_url.rstrip("/"))
        levels = []
        for c in args.levels:
            count = args.requests_per_level or max(8, 4 * c)
            levels.append(await run_level(session, args, model, c, make_prompts(args, count, rng)))
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "levels")}
    return {"command": args.command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "url": args.base_url, "model": model, "settings": settings, "levels": levels}


# --- the multi-turn agent workload ------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_command", "description": "Run a shell command, return its output",
                                      "parameters": {"type": "object",
                                                     "properties": {"command": {"type": "string"},
                                                                    "timeout_s": {"type": "integer"}},
                                                     "required": ["command"]}}},
]


async def run_conversation(session: aiohttp.ClientSession, url: str, args: argparse.Namespace, model: str,
                           system: str, index: int) -> list[tuple[int, RequestResult]]:
    """One conversation's turns in order: each sends the whole history plus a new user message."""
    rng = random.Random(f"{args.seed}-{index}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    results = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=args.user_tokens))})
        body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if args.ignore_eos:
            body["ignore_eos"] = True
        result = await send_request(session, url, body, "chat")
        results.append((turn, result))
        if not result.ok:
            break
        messages.append({"role": "assistant", "content": result.content})
    return results


def agent_stats(name: str, turns: list[tuple[int, RequestResult]], wall_s: float) -> dict[str, Any]:
    ok = [r for _, r in turns if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "run": name, "requests": len(turns), "ok": len(ok), "failed": len(turns) - len(ok),
        **ms_stats("ttft", [r.ttft_s for r in ok]),
        "ttft_first_turn_p50_ms": _p50_ms([r.ttft_s for t, r in turns if r.ok and t == 0]),
        "ttft_later_turns_p50_ms": _p50_ms([r.ttft_s for t, r in turns if r.ok and t > 0]),
        "e2e_p50_ms": _p50_ms([r.e2e_s for r in ok]),
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens_computed": prompt - cached,
        "computed_fraction": round((prompt - cached) / prompt, 4) if prompt else None,
        "output_tokens": tokens, "output_tok_s": round(tokens / wall_s, 2), "wall_s": round(wall_s, 3),
        "cached_tokens_missing": sum(r.cached_tokens is None for r in ok),
        "errors": dict(Counter(r.error for _, r in turns if not r.ok)),
    }


def _p50_ms(seconds: list[float]) -> float | None:
    return round(percentile(seconds, 50) * 1000, 2) if seconds else None


async def run_agent(args: argparse.Namespace, base_url: str, name: str) -> dict[str, Any]:
    """All conversations at once against one server."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    system = " ".join(random.Random(args.seed).choices(WORDS, k=args.system_tokens))
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        model = args.model or await first_model(session, base_url.rstrip("/"))
        url = f"{base_url.rstrip('/')}/chat/completions"
        before = await server_metrics(session, base_url)
        start = time.perf_counter()
        runs = await asyncio.gather(*(run_conversation(session, url, args, model, system, i)
                                      for i in range(args.conversations)))
        wall = time.perf_counter() - start
        after = await server_metrics(session, base_url)
    return {**agent_stats(name, [x for run in runs for x in run], wall), **engine_breakdown(before, after),
            "model": model, "url": base_url}


async def server_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """Sample name (labels included) -> value from the server's /metrics; empty when it has none."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with session.get(f"{root}/metrics") as resp:
            return samples(await resp.text()) if resp.status == 200 else {}
    except aiohttp.ClientError:
        return {}


def engine_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Where the run's time to first token went inside a glmflash engine (its /metrics over the run): mean
    queue and prefill time per request, and steps run with their mean wall time by kind."""
    def gained(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean_ms(total: str, count: str) -> float | None:
        return round(gained(total) / gained(count) * 1000, 2) if gained(count) else None

    out: dict[str, float | None] = {}
    for part in ("queue", "prefill"):
        metric = f"glmflash_request_{part}_time_seconds"
        out[f"engine_{part}_mean_ms"] = mean_ms(f"{metric}_sum", f"{metric}_count")
    for kind in ("prefill", "decode"):
        steps = f'glmflash_engine_steps{{kind="{kind}"}}'
        out[f"{kind}_steps"] = gained(steps) if steps in after else None
        out[f"{kind}_step_mean_ms"] = mean_ms(f'glmflash_engine_step_seconds{{kind="{kind}"}}', steps)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def started_server(args: argparse.Namespace, prefix_cache: bool) -> Iterator[str]:
    """`glmflash serve` in a child process (its own cores and GIL), prefix cache on or off -> its /v1 URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", args.device]
    cmd += [] if args.serve == "tiny" else ["--model", args.serve]
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
    env = {**os.environ, "GLMFLASH_PREFIX_CACHE": "on" if prefix_cache else "off", "GLMFLASH_LOG_LEVEL": "WARNING",
           **dict(kv.split("=", 1) for kv in args.serve_env)}
    if args.server_log:  # kept, at INFO: the start's stages and each kernel compile the requests waited on
        args.server_log.mkdir(parents=True, exist_ok=True)
        env["GLMFLASH_LOG_LEVEL"] = "INFO"
        opened = (args.server_log / f"serve-cache-{'on' if prefix_cache else 'off'}.log").open("w+")
    else:
        opened = tempfile.TemporaryFile("w+")
    with opened as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, args.ready_timeout, log)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()  # SIGTERM: glmflash drains and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"glmflash exited with {proc.returncode} before it was ready:\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"glmflash was not ready after {timeout_s:.0f} s")


def agent_report(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    if args.serve:
        for on in (True, False):
            with started_server(args, on) as url:
                runs.append(asyncio.run(run_agent(args, url, "cache_on" if on else "cache_off")))
            print(f"# measured {run_line(runs[-1])}", flush=True)  # kept should the next run be cut short
    else:
        runs.append(asyncio.run(run_agent(args, args.base_url, "server")))
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "levels")}
    report = {"command": args.command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "settings": settings, "runs": runs}
    if len(runs) == 2 and runs[1]["prefill_tokens_computed"]:  # none when every cache-off request failed
        on, off = runs
        report["computed_drop"] = round(1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"], 4)
        if on["ttft_p50_ms"] and off["ttft_p50_ms"]:
            report["ttft_p50_speedup"] = round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2)
    return report


def agent_table(runs: list[dict[str, Any]]) -> str:
    cols = [("run", "run"), ("ok", "ok"), ("fail", "failed"), ("TTFT p50", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"),
            ("turn-1 p50", "ttft_first_turn_p50_ms"), ("later p50", "ttft_later_turns_p50_ms"),
            ("prompt tok", "prompt_tokens"), ("computed tok", "prefill_tokens_computed"),
            ("computed", "computed_fraction"), ("out tok/s", "output_tok_s"), ("wall s", "wall_s")]
    return _table(cols, runs) + "\n(times in ms; computed = prompt tokens less usage.prompt_tokens_details.cached_tokens)"


def run_line(run: dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt(v)}" for k, v in run.items() if k != "errors")


def agent_lines(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    head = (f"bench workload=agent conversations={s['conversations']} turns={s['turns']} "
            f"system_words={s['system_tokens']} user_words={s['user_tokens']} max_tokens={s['max_tokens']} "
            f"serve={s['serve'] or s['base_url']} device={s['device'] if s['serve'] else 'na'} date={report['date']}")
    lines = [head] + [run_line(run) for run in report["runs"]]
    if "computed_drop" in report:
        lines.append(f"compare computed_drop={report['computed_drop']} ttft_p50_speedup={report.get('ttft_p50_speedup')}")
    for run in report["runs"]:
        lines += [f"# run={run['run']} {n}x {err}" for err, n in run["errors"].items()]
        if run["cached_tokens_missing"]:
            lines.append(f"# run={run['run']} {run['cached_tokens_missing']} responses without cached_tokens: "
                         "counted as computed")
    return lines


def fmt(value: Any) -> str:
    return "na" if value is None else str(value)


def kv_lines(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    head = (f"bench url={report['url']} model={report['model']} endpoint={s['endpoint']} "
            f"prompt_tokens={s['prompt_file'] or s['prompt_tokens']} max_tokens={s['max_tokens']} "
            f"ignore_eos={int(s['ignore_eos'])} seed={s['seed']} date={report['date']}")
    return [head] + [" ".join(f"{k}={fmt(v)}" for k, v in lvl.items() if k != "errors") for lvl in report["levels"]]


def table(levels: list[dict[str, Any]]) -> str:
    cols = [("C", "level"), ("ok", "ok"), ("fail", "failed")]
    cols += [(f"TTFT {s}", f"ttft_{s}_ms") for s in STAT_FIELDS] + [(f"ITL {s}", f"itl_{s}_ms") for s in STAT_FIELDS]
    cols += [("E2E p50", "e2e_p50_ms"), ("out tok/s", "output_tok_s"), ("req/s", "req_s")]
    return _table(cols, levels) + "\n(times in ms)"


def _table(cols: list[tuple[str, str]], rows_in: list[dict[str, Any]]) -> str:
    rows = [[title for title, _ in cols]] + [[fmt(row[key]) for _, key in cols] for row in rows_in]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def notes(report: dict[str, Any]) -> list[str]:
    out = []
    for lvl in report["levels"]:
        out += [f"# level={lvl['level']} {n}x {err}" for err, n in lvl["errors"].items()]
        if lvl["usage_missing"]:
            out.append(f"# level={lvl['level']} no usage in {lvl['usage_missing']} streams: tokens counted as chunks")
        if report["settings"]["ignore_eos"] and lvl["below_max_tokens"]:
            out.append(f"# level={lvl['level']} {lvl['below_max_tokens']} requests stopped before --max-tokens "
                       "despite --ignore-eos: the server seems to ignore ignore_eos")
    return out


def write_json(path: str, report: dict[str, Any]) -> None:
    """The report as JSON (paths among its settings as strings)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload == "agent":
        report = agent_report(args)
        print(f"# {report['command']}")
        print(agent_table(report["runs"]))
        print("\n".join(agent_lines(report)))
        if args.json_out:
            write_json(args.json_out, report)
        return 1 if any(run["failed"] for run in report["runs"]) else 0
    if args.serve:  # one started server, its defaults (the prefix cache on: the random prompts share nothing)
        with started_server(args, prefix_cache=True) as args.base_url:
            report = asyncio.run(run(args))
    else:
        report = asyncio.run(run(args))
    print(f"# {report['command']}")
    print(table(report["levels"]))
    print("\n".join(kv_lines(report) + notes(report)))
    if args.json_out:
        write_json(args.json_out, report)
    return 1 if any(lvl["failed"] for lvl in report["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
