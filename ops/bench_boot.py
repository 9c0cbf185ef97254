"""Container-start figures against the disk: process start to /ready and to the first streamed token, cold
and fast_resume, with the page cache dropped for the files each start reads, next to the raw read time
of those same bytes measured in the same run.

The model is a snapshot directory on the volume (`--model DIR`, e.g. a full-width slice), a synthetic
full-width slice built first (`--slice-gib N --slice-dir DIR`, see ops/slice_snapshot.py; kept for the
next run), or, with neither, the embedded tiny model. Each round:

  cold         the prepared snapshot and the compiled kernels (`<cache>/triton`) are removed; the original
               shards are raw-read (evicted before and after); `glmflash boot` starts; after the first token the
               bench times back-to-back completions while the prepared snapshot is written (after ready) and
               after it (`writing_tok_s`, `after_write_tok_s`: decode during the write should stay within 80% of
               decode after it), stops the worker and raw-reads the shards again;
  fast_resume  the same around a second `glmflash boot`, with the prepared files and the kernels the cold
               start compiled (a restarted container on the same volume).

Each start is compared with the faster of its two raw reads (see ops/page_cache.py).

With `--ready-at partial` both starts serve before the routed experts are all in (GLMFLASH_READY_AT): the
bench also reports the tok/s of back-to-back completions while the experts fill in (`loading_tok_s`), when
the fill ended (`experts_loaded_s`, from process start, to the end of the completion that saw it) and the
tok/s after (`loaded_tok_s`). GLMFLASH_EXPERT_FILL_GBPS in the environment slows the fill (the tiny
model's is otherwise over before the first request).

Targets (issue "The first minutes of a worker"): cold ready <= raw read of the snapshot + 10 s; fast_resume
ready <= raw read of the prepared snapshot + 5 s; with partial, first token within
PARTIAL_FIRST_TOKEN_S of process start (at real size).

    python -m ops.bench_boot --cache-dir /workspace/boot-bench --slice-gib 20 --slice-dir /workspace/slice-20g \
        [--rounds 1] [--ready-at partial] [-- --device cuda ...more glmflash boot flags]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from engine.checkpoint.loader import shard_files
from engine.checkpoint.prepared_store import read_plan
from ops.page_cache import evict, faster, raw_read
from worker.provisioning import model_spec
from worker.settings import Settings

TARGETS = {"cold": (1.0, 10.0), "fast_resume": (1.0, 5.0)}  # ready within factor x raw read + seconds
PARTIAL_FIRST_TOKEN_S = 30.0
LOADING_MAX_TOKENS = 16
PROBE_TOKENS = 64  # a completion timed while the prepared snapshot is written, and after: mostly decode
WRITING = ("writing", "after_experts")  # /ready's prepared_snapshot while the write is under way or due
WRITING_FLOOR = 0.8  # decode while writing, of decode after (issue "The first minutes of a worker")


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


def timed_completion(url: str, max_tokens: int = LOADING_MAX_TOKENS) -> tuple[int, float]:
    """(tokens generated, seconds) of one greedy completion run to `max_tokens`."""
    body = json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        tokens = json.load(response)["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - start


def while_loading(url: str, process_start: float) -> dict:
    """Tok/s of back-to-back completions while the experts fill in, when the fill ended, and tok/s after."""
    tokens = seconds = 0.0
    while _experts_loading(url):
        n, s = timed_completion(url)
        tokens, seconds = tokens + n, seconds + s
    loaded_s = time.perf_counter() - process_start
    n, s = timed_completion(url)
    return {"loading_tok_s": round(tokens / seconds, 2) if seconds else None, "experts_loaded_s": round(loaded_s, 3),
            "loaded_tok_s": round(n / s, 2)}


def while_writing(url: str) -> dict:
    """Decode tok/s of back-to-back completions while the prepared snapshot is written after ready (the writer
    must leave serving its cores, memory bandwidth and page cache), against the same completions after it."""
    tokens = seconds = 0.0
    while (ready_body(url) or {}).get("prepared_snapshot") in WRITING:
        n, s = timed_completion(url, PROBE_TOKENS)
        tokens, seconds = tokens + n, seconds + s
    after = [timed_completion(url, PROBE_TOKENS) for _ in range(3)]
    writing = tokens / seconds if seconds else None
    steady = max(n / s for n, s in after)
    return {"writing_tok_s": round(writing, 2) if writing else None, "after_write_tok_s": round(steady, 2),
            "writing_over_after": round(writing / steady, 3) if writing else None}


def _experts_loading(url: str) -> bool:
    share = (ready_body(url) or {}).get("experts_loaded", 1.0)
    if share == "failed":  # nothing more will come in: the server's log says why
        raise SystemExit("the expert fill failed")
    return share < 1.0


def ready_body(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            return json.load(response) if response.status == 200 else None
    except OSError:
        return None


def one_start(cache_dir: Path, flags: list[str], wait_prepared: bool, partial: bool = False,
              log_file: Path | None = None) -> dict:
    """One `glmflash boot`, timed from process start; stopped (SIGTERM) once measured. Its output (the stage
    and event= lines) goes to a file as it is printed (a pipe nobody reads could fill and stall the server),
    `log_file` when given: kept even when a time limit cuts the run."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if log_file is None:
        handle, name = tempfile.mkstemp(suffix=".log")
        os.close(handle)
        out_path = Path(name)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        out_path = log_file
    result: dict = {}
    with out_path.open("w") as out:
        start, wall_start = time.perf_counter(), time.time()
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "boot", "--host", "127.0.0.1", "--port",
                                 str(port), "--cache-dir", str(cache_dir), *flags], stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        try:
            while (ready := ready_body(url)) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"boot exited with {proc.returncode}: {out_path.read_text()}")
                time.sleep(0.05)
            result["ready_s"] = round(time.perf_counter() - start, 3)
            result["first_token_s"] = round(result["ready_s"] + first_token_s(url), 3)
            result["experts_at_ready"] = ready.get("experts_loaded")
            if partial:
                result.update(while_loading(url, start))
            if wait_prepared:
                ready = ready_body(url) or {}
                if ready.get("prepared_snapshot") in WRITING:
                    result.update(while_writing(url))
                    ready = ready_body(url) or {}
            result["prepared_snapshot"] = ready.get("prepared_snapshot")
            result["prepared_write_s"] = ready.get("prepared_s")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=600)
    output = out_path.read_text()
    if log_file is None:
        out_path.unlink()
    stages = {m.group(1): float(m.group(2)) for m in re.finditer(r"PROVISION_STAGE=(\S+) elapsed_s=([\d.]+)", output)}
    load = re.search(r"PROVISION_STAGE=load .*?read_gb_s=([\d.]+)", output)
    result.update(path="fast_resume" if "fast_resume" in stages else "cold", stages=stages,
                  events=critical_path(output, wall_start), exit_code=proc.returncode,
                  loader_gb_s=float(load.group(1)) if load else None)
    return result


# What a start waits on, in its log: the events that mark the critical path, and the seconds each reports.
PATH_EVENTS = ("readahead", "compile_cache", "listening", "memory_plan", "load_timing", "prepared_load",
               "kernel_preload", "warm_up_wait", "graph_capture", "decode_graphs", "decode_probe", "prefill_warm_up",
               "kernel_compiles")
EVENT_SECONDS = re.compile(r"\b(wall_s|read_s|waited_s|capture_s|seconds)=([\d.]+)")
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?\bevent=(\w+)(.*)$")


def critical_path(output: str, wall_start: float) -> dict[str, str]:
    """Each path event's first time in the log, in seconds from process start (the log's clock), with the
    seconds it reports (`at+seconds`): where a start's time goes between the imports and ready."""
    seen: dict[str, str] = {}
    for line in output.splitlines():
        match = LOG_LINE.match(line)
        if match is None or match.group(2) not in PATH_EVENTS or match.group(2) in seen:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_start
        took = EVENT_SECONDS.search(match.group(3))
        seen[match.group(2)] = f"{at:.2f}" + (f"+{float(took.group(2)):.2f}" if took else "")
    return seen


def report(path: str, raw: tuple[int, float], start: dict) -> None:
    raw_bytes, raw_s = raw
    factor, plus = TARGETS[path]
    target = factor * raw_s + plus
    line = {"path": start["path"], "bytes": raw_bytes, "raw_read_s": round(raw_s, 3),
            "raw_gb_s": round(raw_bytes / raw_s / 1e9, 3), "ready_s": start["ready_s"],
            "first_token_s": start["first_token_s"], "ready_over_raw": round(start["ready_s"] / raw_s, 2),
            "target_s": round(target, 2), "within_target": start["ready_s"] <= target,
            "loader_gb_s": start["loader_gb_s"], "prepared_write_s": start["prepared_write_s"],
            "exit_code": start["exit_code"]}
    if "after_write_tok_s" in start:
        ratio = start["writing_over_after"]
        line.update({k: start[k] for k in ("writing_tok_s", "after_write_tok_s", "writing_over_after")},
                    writing_within_target=ratio is not None and ratio >= WRITING_FLOOR)
    if "experts_loaded_s" in start:
        line.update({k: start[k] for k in ("experts_at_ready", "loading_tok_s", "experts_loaded_s", "loaded_tok_s")},
                    first_token_within_target=start["first_token_s"] <= PARTIAL_FIRST_TOKEN_S)
    print(" ".join(f"{k}={v}" for k, v in line.items()), flush=True)
    print("  stages: " + " ".join(f"{k}={v}" for k, v in start["stages"].items()), flush=True)
    print("  events (s from process start+s taken): " + " ".join(f"{k}={v}" for k, v in start["events"].items()),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="a snapshot directory on the volume")
    parser.add_argument("--slice-gib", type=float, help="build (once) a synthetic full-width slice of this size")
    parser.add_argument("--slice-dir", type=Path, help="where the slice is built (required with --slice-gib)")
    parser.add_argument("--slice-format", default="nvfp4-ct")
    parser.add_argument("--rounds", type=int, default=1, help="cold + fast_resume pairs")
    parser.add_argument("--workers", type=int, default=8, help="parallel reads of the raw-read figure")
    parser.add_argument("--ready-at", choices=("loaded", "partial"), default="loaded",
                        help="partial: serve before the routed experts are in, and measure tok/s while they load")
    parser.add_argument("--log-dir", type=Path, help="keep each start's server output here (cold-N.log, "
                        "fast_resume-N.log, with -partial before -N under --ready-at partial)")
    parser.add_argument("flags", nargs="*", help="flags passed to glmflash boot (after --)")
    args = parser.parse_args()
    model = args.model
    if args.slice_gib:
        from ops.slice_snapshot import write_slice_snapshot

        if args.slice_dir is None:
            parser.error("--slice-gib needs --slice-dir")
        if not (args.slice_dir / "model.safetensors.index.json").exists():
            _, size = write_slice_snapshot(args.slice_dir, args.slice_gib, args.slice_format)
            print(f"built slice={args.slice_dir} bytes={size}", flush=True)
        model = args.slice_dir
    partial = args.ready_at == "partial"
    flags = [*args.flags, *(["--model", str(model)] if model else []), "--ready-at", args.ready_at]
    source = Path(model_spec(Settings(model=str(model) if model else None, cache_dir=args.cache_dir))[0])
    shards = shard_files(source)

    def log_file(path: str, n: int) -> Path | None:
        return args.log_dir / f"{path}{'-partial' if partial else ''}-{n}.log" if args.log_dir else None

    for n in range(args.rounds):
        for kept in ("models", "triton"):  # cold is a fresh volume: no prepared snapshot, no compiled kernels
            shutil.rmtree(args.cache_dir / kept, ignore_errors=True)
        before = raw_read(shards, args.workers)
        cold = one_start(args.cache_dir, flags, wait_prepared=True, partial=partial, log_file=log_file("cold", n))
        report("cold", faster(before, raw_read(shards, args.workers)), cold)
        prepared = next((args.cache_dir / "models").iterdir()) / "prepared"
        files = [prepared / name for name in read_plan(prepared).files]
        before = raw_read(files, args.workers)
        evict(shards)
        fast = one_start(args.cache_dir, flags, wait_prepared=False, partial=partial,
                         log_file=log_file("fast_resume", n))
        report("fast_resume", faster(before, raw_read(files, args.workers)), fast)


if __name__ == "__main__":
    main()
