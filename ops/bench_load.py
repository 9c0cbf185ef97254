"""Prepared-snapshot load rate against the disk's own read rate, with the page cache dropped for both.

Builds synthetic weights of the real expert shapes (NVFP4 stacks of 288 experts, as many MoE
layers as fit --gib) plus a non-expert part, writes them as a prepared snapshot, evicts the files
from the page cache (posix_fadvise DONTNEED), then measures:
  - raw: parallel 64 MiB preads of the same files into one reused buffer (the disk's rate here);
  - load: `load_prepared` into final buffers, with and without hash verification.

    python ops/bench_load.py --dir /workspace/bench-load --gib 8 [--device cuda] [--workers 8,16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.checkpoint.prepared import load_prepared, save_prepared
from engine.weights import DenseWeight, Nvfp4Weight

EXPERTS, HIDDEN, INTER = 288, 4096, 2048


def synthetic_weights(gib: float) -> dict:
    """Random bytes in the real per-layer layout: one stacked NVFP4 expert bank per MoE layer."""
    layer_bytes = 3 * EXPERTS * (HIDDEN * INTER // 2 + HIDDEN * INTER // 16 + 4)
    layers = max(1, int(gib * 2**30 * 0.9 // layer_bytes))
    weights: dict = {"embed_tokens.weight": torch.randint(0, 255, (int(gib * 2**30 * 0.1) // 2 * 2,), dtype=torch.uint8)
                     .view(torch.bfloat16)}
    weights["lm_head"] = DenseWeight(torch.zeros(8, 8, dtype=torch.bfloat16))
    for i in range(layers):
        for proj, (n, k) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}.items():
            weights[f"layers.{i}.mlp.experts.{proj}"] = Nvfp4Weight(
                torch.randint(0, 255, (EXPERTS, n, k // 2), dtype=torch.uint8),
                torch.randint(0, 126, (EXPERTS, n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn),
                torch.ones(EXPERTS, 1))
    return weights


def _bytes(weight) -> torch.Tensor:
    """All of a weight's buffers as one flat byte tensor (to compare loads bit for bit)."""
    tensors = [weight] if isinstance(weight, torch.Tensor) else [v for v in vars(weight).values()
                                                                 if isinstance(v, torch.Tensor)]
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1).cpu() for t in tensors])


def evict(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(directory: Path, workers: int, piece: int = 64 << 20) -> tuple[int, float]:
    jobs = [(p, off) for p in sorted(directory.glob("*.bin")) for off in range(0, p.stat().st_size, piece)]

    def read(job) -> int:
        path, offset = job
        buf = bytearray(piece)
        with open(path, "rb", buffering=0) as f:
            return os.preadv(f.fileno(), [buf], offset)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(read, jobs))
    return total, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--workers", default="8", help="comma-separated reader counts to measure")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    start = time.perf_counter()
    weights = synthetic_weights(args.gib)
    plan = save_prepared(weights, args.dir)
    size = sum(plan.files.values())
    print(f"prepared_bytes={size} files={len(plan.files)} write_s={time.perf_counter() - start:.2f}", flush=True)
    for workers in (int(w) for w in args.workers.split(",")):
        evict(args.dir)
        total, seconds = raw_read(args.dir, workers)
        raw = total / seconds / 1e9
        print(f"raw_read_gb_s={raw:.3f} bytes={total} s={seconds:.2f} workers={workers}", flush=True)
        for verify in (True, False):
            evict(args.dir)
            start = time.perf_counter()
            loaded, stats = load_prepared(args.dir, args.device, workers, verify)
            wall = time.perf_counter() - start
            same = all(torch.equal(_bytes(loaded[name]).cpu(), _bytes(w)) for name, w in weights.items())
            print(f"load_verify={int(verify)} workers={workers} read_gb_s={stats.gb_per_s:.3f} "
                  f"wall_gb_s={size / wall / 1e9:.3f} ratio_to_raw={stats.gb_per_s / raw:.2f} device={args.device} "
                  f"identical={same}", flush=True)
            del loaded
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
