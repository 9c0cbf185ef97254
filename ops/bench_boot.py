"""Container-start figures: time to ready and time to the first token, for a cold start and a fast resume.

Starts `glmflash boot` twice on the same cache directory (the first start is cold unless the cache
is already prepared), and for each reports the stage lines' timings, when /ready turned 200, and
the time from process start to the first streamed token of one request.

    python ops/bench_boot.py --cache-dir /tmp/boot-bench [-- extra glmflash boot flags, e.g. --model DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_token_s(url: str) -> float:
    """Seconds until the first streamed text chunk of one completion."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {"):
                return time.perf_counter() - start
    raise RuntimeError("stream ended without a chunk")


def one_start(cache_dir: Path, extra: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "boot", "--host", "127.0.0.1", "--port", str(port),
                             "--cache-dir", str(cache_dir), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"boot exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=1) as response:
                    if response.status == 200:
                        ready = json.load(response)
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready_s = time.perf_counter() - start
        ttft_s = ready_s + first_token_s(url)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    stages = {m.group(1): float(m.group(2)) for m in re.finditer(r"PROVISION_STAGE=(\S+) elapsed_s=([\d.]+)", output)}
    path = "fast_resume" if "fast_resume" in stages else "cold"
    return {"path": path, "ready_after_start_s": round(ready_s, 3), "first_token_after_start_s": round(ttft_s, 3),
            "fully_loaded_s": stages.get("warmup"), "stages": stages, "exit_code": proc.returncode,
            "served_before_all_experts": False, "ready_detail": {k: ready.get(k) for k in ("model", "stage")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="flags passed to glmflash boot (after --)")
    args = parser.parse_args()
    for _ in range(args.starts):
        result = one_start(args.cache_dir, args.extra)
        print(" ".join(f"{k}={v}" for k, v in result.items() if k != "stages"), flush=True)
        print("  stages: " + " ".join(f"{k}={v}" for k, v in result["stages"].items()), flush=True)


if __name__ == "__main__":
    main()
