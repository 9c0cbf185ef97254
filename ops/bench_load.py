"""Load rates against the disk's own read rate, with the page cache dropped for every read (ops/page_cache.py).

Prepared snapshot (default): builds synthetic weights of the real expert shapes (NVFP4 stacks of 288
experts, as many MoE layers as fit --gib) plus a non-expert part, writes them as a prepared snapshot
(timed), then measures:
  - raw: parallel 64 MiB preads of the same files (the disk's rate here), before and after the loads;
  - load: `load_prepared` into final buffers, with and without hash verification.

Original checkpoint (--checkpoint DIR, e.g. a slice from ops/slice_snapshot.py): the cold start's one
pass, `load_weights` of the safetensors shards, against the raw read of those shards (before and after)
and against the rate at which fresh host memory can be filled (the bound of a load into host RAM).

    python -m ops.bench_load --dir /workspace/bench-load --gib 8 [--device cuda] [--workers 8,16]
    python -m ops.bench_load --checkpoint /workspace/slice-20g [--device cuda] [--expert-device cpu]
"""

from __future__ import annotations

import argparse
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.checkpoint.loader import load_weights, shard_files
from engine.checkpoint.prepared import load_prepared, save_prepared
from engine.config import ModelConfig
from engine.weights import DenseWeight, Nvfp4Weight
from ops.page_cache import evict, faster, raw_read

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


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fresh_fill_s(nbytes: int, workers: int, piece: int = 64 << 20) -> float:
    """Seconds to fill `nbytes` of newly allocated host memory from `workers` threads: the bound of any
    load into host RAM that is not pinned up front (a virtual machine's page faults can be slower than its disk)."""
    source = torch.zeros(piece, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)

    def fill(offset: int) -> None:
        target[offset:offset + piece].copy_(source[:min(piece, nbytes - offset)])

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, range(0, nbytes, piece)))
    return time.perf_counter() - start


def bench_checkpoint(snapshot: Path, device: str, expert_device: str | None, dtype: torch.dtype,
                     workers: list[int]) -> None:
    shards = shard_files(snapshot)
    cfg = ModelConfig.from_dir(snapshot)
    for count in workers:
        before = raw_read(shards, count)
        start = time.perf_counter()
        loaded = load_weights(snapshot, cfg, device, dtype, expert_device, count)
        sync(device)
        wall = time.perf_counter() - start
        del loaded
        total, seconds = faster(before, raw_read(shards, count))
        print(f"raw_read_gb_s={total / seconds / 1e9:.3f} bytes={total} s={seconds:.2f} workers={count}", flush=True)
        print(f"host_fill_gb_s={total / fresh_fill_s(total, count) / 1e9:.3f} workers={count}", flush=True)
        print(f"cold_pass s={wall:.2f} wall_gb_s={total / wall / 1e9:.3f} ratio_to_raw={seconds / wall:.2f} "
              f"workers={count} device={device} expert_device={expert_device}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="where the synthetic prepared snapshot is written")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--checkpoint", type=Path, help="measure the cold pass over this safetensors snapshot instead")
    parser.add_argument("--expert-device", help="with --checkpoint: where routed experts go (cpu: the host bank)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workers", default="8", help="comma-separated reader counts to measure")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    if args.checkpoint:
        bench_checkpoint(args.checkpoint, args.device, args.expert_device, getattr(torch, args.dtype), counts)
        return
    if args.dir is None:
        parser.error("give --dir (prepared snapshot) or --checkpoint")
    shutil.rmtree(args.dir, ignore_errors=True)
    start = time.perf_counter()
    weights = synthetic_weights(args.gib)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = save_prepared(weights, args.dir, workers=counts[0])
    files = [args.dir / name for name in plan.files]
    evict(files)  # includes the fsync: the write is done once its bytes are on the disk
    size = sum(plan.files.values())
    write_s = time.perf_counter() - start
    print(f"prepared_bytes={size} files={len(plan.files)} build_s={build_s:.2f} write_s={write_s:.2f} "
          f"write_gb_s={size / write_s / 1e9:.3f} workers={counts[0]}", flush=True)
    for workers in counts:
        before = raw_read(files, workers)
        rows = []
        for verify in (True, False):
            evict(files)
            start = time.perf_counter()
            loaded, stats = load_prepared(args.dir, args.device, workers, verify)
            wall = time.perf_counter() - start
            same = all(torch.equal(_bytes(loaded[name]).cpu(), _bytes(w)) for name, w in weights.items())
            rows.append((verify, stats, wall, same))
            del loaded
        total, seconds = faster(before, raw_read(files, workers))
        raw = total / seconds / 1e9
        print(f"raw_read_gb_s={raw:.3f} bytes={total} s={seconds:.2f} workers={workers}", flush=True)
        for verify, stats, wall, same in rows:
            print(f"load_verify={int(verify)} workers={workers} read_gb_s={stats.gb_per_s:.3f} "
                  f"wall_gb_s={size / wall / 1e9:.3f} ratio_to_raw={stats.gb_per_s / raw:.2f} device={args.device} "
                  f"identical={same}", flush=True)
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
