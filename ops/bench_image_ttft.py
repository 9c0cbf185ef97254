"""Time to first token of a chat request with a screenshot, against the same request's text alone, through
`glmflash boot` and HTTP (streamed chat completions, wall clock at the client).

The model is a snapshot with a vision tower (e.g. `python -m ops.slice_snapshot DIR --gib 20 --vision`). The
screenshot is a synthetic WIDTHxHEIGHT PNG (windows, bars and lines of text drawn with Pillow) sent as a data
URL. Each round sends the text request, then the image request, each with a different opening line and a
different screenshot, so the prefix cache never answers; a first untimed image request warms the prefill path
up at that size. Reported: each request's prompt tokens and TTFT, and the medians; what the image adds is the
tower's forward plus the prefill of its image tokens.

    python -m ops.bench_image_ttft --model DIR --cache-dir DIR [--rounds 3] [--json PATH] [-- --device cuda ...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from PIL import Image, ImageDraw

from ops.bench_boot import free_port, ready_body
from ops.bench_serve import RequestResult, send_request

QUESTION = "What does the error dialog in this screenshot say, and which button should I press?"


def screenshot(width: int, height: int, seed: int) -> bytes:
    """A PNG that looks like a desktop: a title bar, side panel, windows with lines of text and a dialog."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (rng.randrange(40, 90),) * 3)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 32), fill=(30, 30, 36))
    draw.rectangle((0, 32, width // 6, height), fill=(45, 48, 56))
    for _ in range(4):
        x0, y0 = rng.randrange(width // 6, width // 2), rng.randrange(40, height // 2)
        x1, y1 = min(width - 10, x0 + rng.randrange(400, 900)), min(height - 10, y0 + rng.randrange(250, 500))
        draw.rectangle((x0, y0, x1, y1), fill=(245, 245, 245), outline=(120, 120, 120))
        for line_y in range(y0 + 30, y1 - 10, 18):
            words = " ".join(rng.choice(("build", "error", "file", "line", "open", "save", "run", "test", "ok"))
                             for _ in range(rng.randrange(3, 12)))
            draw.text((x0 + 12, line_y), words, fill=(20, 20, 20))
    draw.rectangle((width // 2 - 220, height // 2 - 90, width // 2 + 220, height // 2 + 90), fill=(250, 250, 250),
                   outline=(200, 40, 40), width=3)
    draw.text((width // 2 - 200, height // 2 - 70), f"Error {seed}: the disk is full", fill=(200, 40, 40))
    draw.rectangle((width // 2 + 100, height // 2 + 40, width // 2 + 200, height // 2 + 75), fill=(60, 120, 220))
    draw.text((width // 2 + 130, height // 2 + 50), "Retry", fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def chat_body(model: str, text: str, image: bytes | None, max_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}


async def measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{base}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{base}/v1/models") as response:
            card = (await response.json())["data"][0]
        model = card["id"]

        async def one(text: str, image: bytes | None) -> RequestResult:
            result = await send_request(session, url, chat_body(model, text, image, args.max_tokens), "chat")
            if not result.ok:
                raise SystemExit(f"request failed: {result.error}")
            return result

        await one("Warm-up. " + QUESTION, screenshot(args.width, args.height, seed=10_000))
        rounds = []
        for i in range(args.rounds):
            text = f"Round {i}. {QUESTION}"
            plain = await one(text, None)
            image = screenshot(args.width, args.height, seed=i)
            with_image = await one(text, image)
            rounds.append({"text_ttft_ms": plain.ttft_s * 1e3, "text_prompt_tokens": plain.prompt_tokens,
                           "image_ttft_ms": with_image.ttft_s * 1e3, "image_prompt_tokens": with_image.prompt_tokens,
                           "png_bytes": len(image)})
            print(" ".join(["event=image_ttft", f"round={i}"] + [f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                                  for k, v in rounds[-1].items()]), flush=True)
    text_ms = statistics.median(r["text_ttft_ms"] for r in rounds)
    image_ms = statistics.median(r["image_ttft_ms"] for r in rounds)
    return {"model": model, "input_modalities": card.get("input_modalities"), "size": f"{args.width}x{args.height}",
            "rounds": rounds, "text_ttft_ms": text_ms, "image_ttft_ms": image_ms, "image_adds_ms": image_ms - text_ms,
            "image_tokens": rounds[0]["image_prompt_tokens"] - rounds[0]["text_prompt_tokens"]}


def boot(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "worker.cli", "boot", "--host", "127.0.0.1", "--port", str(port), "--cache-dir",
           str(args.cache_dir), "--model", str(args.model), *args.boot_flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.ready_timeout
    while ready_body(base) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"boot did not become ready (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    return proc, base


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="snapshot directory with a vision tower")
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1920)
    parser.add_argument("--height", type=int, default=1080)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, help="the server's output (default: a temporary file)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("boot_flags", nargs="*", help="after --: more `glmflash boot` flags")
    args = parser.parse_args(argv)
    log = args.log or Path(tempfile.mkstemp(suffix=".log")[1])
    proc, base = boot(args, log)
    try:
        report = asyncio.run(measure(base, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items()
                   if k != "rounds"), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
