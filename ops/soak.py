"""Soak under faults: a glmflash worker under steady mixed load with clients leaving mid-stream, then stopped.

Starts `glmflash boot` in a child process and runs `--streams` client loops through the official `openai` client
for `--seconds`: streamed and whole chat answers and completions of mixed prompt and answer lengths, tool calls
(`tools`) and JSON answers (`response_format` json_schema) among them, and `--disconnect` of the streams closed by
their client after a few chunks. Every request the server accepted must end whole: a finish reason, `length` only
at its max_tokens, a JSON answer that parses, no error. Then the load pauses and /metrics must agree with the
clients (every request counted once, 200 or 499, none 5xx; nothing running or queued). The worker's resident
memory, open file descriptors and GPU memory are sampled as it runs: none may grow from the sample after the first
fifth of the run to the last. Finally a burst of requests is started and SIGTERM sent while they run: each must
still end whole within the drain grace, and the worker exit 0.

    python -m ops.soak --serve tiny --device cpu --seconds 60 --streams 8
    python -m ops.soak --serve /models/slice --device cuda --seconds 300 --streams 32 --max-tokens 256 --json soak.json

Exit status 1 when any check fails; the report (printed, and with --json written) says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from ops.bench_serve import WORDS, free_port, wait_ready
from worker.metrics import samples

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("stream", "whole", "tools", "json", "completion")
WEIGHTS = (0.45, 0.15, 0.15, 0.1, 0.15)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# Growth allowed between the samples: allocator rounding and a log line's buffers, not a leak per request.
RSS_SLACK_BYTES, FD_SLACK, GPU_SLACK_BYTES = 64 << 20, 4, 64 << 20


@dataclass
class Tally:
    sent: int = 0
    whole: int = 0  # ended with a finish reason, as asked
    left: int = 0  # streams their client closed on purpose
    refused: int = 0  # refused before acceptance (429 at capacity, 503 once stopping)
    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    failures: list[str] = field(default_factory=list)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_request(client: AsyncOpenAI, model: str, rng: random.Random, args: argparse.Namespace,
                      tally: Tally) -> None:
    """One request of a random kind, checked as it ends."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    max_tokens = rng.randint(4, args.max_tokens)
    messages = [{"role": "user", "content": prompt(rng, rng.randint(8, args.prompt_words))}]
    leave = kind in ("stream", "completion") and rng.random() < args.disconnect
    tally.sent += 1
    tally.by_kind[kind] += 1
    try:
        if kind == "completion":
            finish, count = await _streamed(await client.completions.create(
                model=model, prompt=messages[0]["content"], max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), leave)
        elif kind == "stream":
            finish, count = await _streamed(await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), leave)
        elif kind == "tools":
            finish, count = await _streamed(await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, tools=TOOLS, stream=True,
                stream_options={"include_usage": True}), False)
        else:
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}} \
                if kind == "json" else {"extra_body": {"ignore_eos": True}}
            answer = await client.chat.completions.create(model=model, messages=messages,
                                                          max_tokens=256 if kind == "json" else max_tokens, **extra)
            finish, count = answer.choices[0].finish_reason, answer.usage.completion_tokens
            if kind == "json" and finish == "stop":
                json.loads(answer.choices[0].message.content)
    except Exception as exc:  # noqa: BLE001 - every failure is the soak's finding, named in the report
        status = getattr(exc, "status_code", None)
        if status in (429, 503):
            tally.refused += 1
            return
        tally.failures.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")
        return
    if finish is None and leave:
        tally.left += 1
    elif finish not in ("stop", "length", "tool_calls") or (finish == "length" and count != max_tokens
                                                              and kind != "json"):
        tally.failures.append(f"{kind}: finish={finish} tokens={count} max_tokens={max_tokens}")
    else:
        tally.whole += 1


async def _streamed(stream, leave: bool) -> tuple[str | None, int | None]:
    """(finish reason, completion tokens from the usage chunk) of a stream; closed after 2 chunks when `leave`
    (then (None, None))."""
    finish, tokens, chunks = None, None, 0
    async for chunk in stream:
        chunks += 1
        if leave and chunks == 2:
            await stream.close()
            return None, None
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return finish, tokens


async def client_loop(client: AsyncOpenAI, model: str, seed: int, args: argparse.Namespace, tally: Tally,
                      until: asyncio.Event) -> None:
    rng = random.Random(seed)
    while not until.is_set():
        await one_request(client, model, rng, args, tally)


@dataclass
class Sample:
    at_s: float
    rss_bytes: int
    fds: int
    gpu_bytes: int | None


def sample(pid: int, start: float) -> Sample:
    """The worker's resident memory and open descriptors (Linux /proc) and its GPU memory (nvidia-smi, when
    there is one)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(round(time.monotonic() - start, 1), rss, fds, _gpu_bytes(pid))


def _gpu_bytes(pid: int) -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [int(m) for p, m in (line.split(", ") for line in out.strip().splitlines() if ", " in line)
            if int(p) == pid]
    return used[0] << 20 if used else None


async def metrics(client: AsyncOpenAI, base_url: str) -> dict[str, float]:
    response = await client._client.get(base_url.removesuffix("/v1") + "/metrics")
    return samples(response.text)


def metric_checks(page: dict[str, float], tally: Tally) -> list[str]:
    """/metrics against the clients' own counts, with no request in flight."""
    def total(code: str) -> float:
        return sum(v for k, v in page.items() if k.startswith("glmflash_requests_total{") and f'status="{code}"' in k
                   and ("/v1/chat/completions" in k or "/v1/completions" in k))
    problems = []
    counted = total("200") + total("499") + total("429") + total("503")
    if counted != tally.sent:
        problems.append(f"/metrics counts {counted:.0f} API requests (200, 499, 429, 503), the clients sent {tally.sent}")
    errors = sum(v for k, v in page.items() if k.startswith("glmflash_requests_total{") and 'status="5' in k
                 and 'status="503"' not in k)
    if errors:
        problems.append(f"/metrics counts {errors:.0f} server errors")
    for gauge in ("glmflash_requests_running", "glmflash_requests_waiting"):
        if page.get(gauge, 0):
            problems.append(f"{gauge} is {page[gauge]:.0f} with no request in flight")
    return problems


def growth_checks(samples_: list[Sample], seconds: float) -> list[str]:
    """From the first sample after a fifth of the run to the last, nothing may grow past its slack."""
    early = next((s for s in samples_ if s.at_s >= seconds / 5), None)
    if early is None or early is samples_[-1]:
        return ["too few samples to compare"]
    last, problems = samples_[-1], []
    if last.rss_bytes - early.rss_bytes > RSS_SLACK_BYTES + early.rss_bytes // 20:
        problems.append(f"resident memory grew {early.rss_bytes >> 20} -> {last.rss_bytes >> 20} MiB")
    if last.fds - early.fds > FD_SLACK:
        problems.append(f"open descriptors grew {early.fds} -> {last.fds}")
    if early.gpu_bytes is not None and last.gpu_bytes is not None and \
            last.gpu_bytes - early.gpu_bytes > GPU_SLACK_BYTES:
        problems.append(f"GPU memory grew {early.gpu_bytes >> 20} -> {last.gpu_bytes >> 20} MiB")
    return problems


async def soak(args: argparse.Namespace, proc: subprocess.Popen, base_url: str) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base_url, api_key="soak", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    start, tally, samples_ = time.monotonic(), Tally(), []
    until = asyncio.Event()
    loops = [asyncio.create_task(client_loop(client, model, seed, args, tally, until)) for seed in range(args.streams)]
    while time.monotonic() - start < args.seconds:
        samples_.append(sample(proc.pid, start))
        await asyncio.sleep(min(args.sample_s, max(0.0, args.seconds - (time.monotonic() - start))))
    samples_.append(sample(proc.pid, start))
    until.set()
    await asyncio.gather(*loops)
    await asyncio.sleep(0.5)  # the server counts a request as its handler returns
    problems = metric_checks(await metrics(client, base_url), tally) + growth_checks(samples_, args.seconds)

    burst = Tally()  # the stop: one request a stream, in flight when SIGTERM comes
    rngs = [random.Random(1000 + i) for i in range(args.streams)]
    requests = [asyncio.create_task(one_request(client, model, rng, args, burst)) for rng in rngs]
    await asyncio.sleep(args.stop_after_s)
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*requests), timeout=args.grace + 60)
    try:
        code = await asyncio.to_thread(proc.wait, args.grace + 60)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        problems.append(f"the worker exited with {code} after SIGTERM")
    problems += [f"after SIGTERM: {f}" for f in burst.failures]
    await client.close()
    report = {"seconds": args.seconds, "streams": args.streams, "sent": tally.sent, "whole": tally.whole,
              "left_on_purpose": tally.left, "refused": tally.refused, "by_kind": tally.by_kind,
              "failures": tally.failures[:20], "failed": len(tally.failures),
              "stop": {"sent": burst.sent, "whole": burst.whole, "refused": burst.refused, "failed": len(burst.failures)},
              "samples": [vars(s) for s in samples_], "problems": problems + tally.failures[:5]}
    report["ok"] = not report["problems"]
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "worker.cli", "boot", "--host", "127.0.0.1", "--port", str(port), "--device",
           args.device, "--cache-dir", str(args.cache_dir)]
    cmd += [] if args.serve == "tiny" else ["--model", args.serve]
    env = {**os.environ, "GLMFLASH_DRAIN_GRACE_S": str(args.grace), "GLMFLASH_LOG_LEVEL": "WARNING"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, args.ready_timeout, log)
            report = asyncio.run(soak(args, proc, f"http://127.0.0.1:{port}/v1"))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not report["ok"]:
            log.seek(0)
            report["worker_log_tail"] = log.read()[-3000:]
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", default="tiny", help="snapshot directory / model id, or 'tiny' (the embedded model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "glmflash-soak")
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--streams", type=int, default=32, help="client loops, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=64, help="the most tokens a request asks for")
    p.add_argument("--prompt-words", type=int, default=200, help="the longest prompt, in words (~1 token each)")
    p.add_argument("--disconnect", type=float, default=0.1, help="share of streams their client leaves mid-way")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--grace", type=float, default=30.0, help="the worker's drain grace (GLMFLASH_DRAIN_GRACE_S)")
    p.add_argument("--stop-after-s", type=float, default=0.5, help="SIGTERM this long after the final burst starts")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "worker_log_tail")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
