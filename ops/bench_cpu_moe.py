"""CPU expert executor speed at the release's expert shapes, next to the host's read bandwidth.

Builds real-shape NVFP4 or FP8-block expert stacks (hidden 4096, expert width 2048; random codes and scales: the
executor's speed does not depend on their values) in host RAM and times the hybrid executor's host
path on batch-1 decode (one token, top-8 misses), the case hybrid offload lives on. In the same run,
on the same threads, a STREAM-style read (a sum over a buffer larger than the caches) gives the
ceiling. Prints one JSON line: executor_GBps, read_GBps, ratio.

    python -m ops.bench_cpu_moe --json            # every core torch sees
    python -m ops.bench_cpu_moe --threads 2 --json
    python -m ops.bench_cpu_moe --format fp8 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.experts.hybrid import HybridExperts, expert_nbytes
from engine.weights import Fp8BlockWeight, Nvfp4Weight

D, I, TOP_K = 4096, 2048, 8


def nvfp4_stack(experts: int, n: int, k: int, gen: torch.Generator) -> Nvfp4Weight:
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(experts, n, k // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, torch.full((experts, 1), 1e-2))


def fp8_stack(experts: int, n: int, k: int, gen: torch.Generator) -> Fp8BlockWeight:
    data = torch.randint(0, 256, (experts, n, k), dtype=torch.uint8, generator=gen)
    data[(data & 0x7F) == 0x7F] = 0  # the two NaN bytes never occur in a checkpoint
    return Fp8BlockWeight(data.view(torch.float8_e4m3fn), torch.rand(experts, n // 128, k // 128, generator=gen) / 64)


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """GB/s of a summing read over `nbytes` (fp32), the best of `reps`."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = min(timed(buf.sum) for _ in range(reps))
    return nbytes / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--format", default="nvfp4", choices=["nvfp4", "fp8"])
    parser.add_argument("--experts", type=int, default=32, help="experts in the host bank (more than top-k, so "
                                                                "consecutive steps read different ones)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    make = nvfp4_stack if args.format == "nvfp4" else fp8_stack
    stacks = (make(args.experts, I, D, gen), make(args.experts, I, D, gen), make(args.experts, D, I, gen))
    hybrid = HybridExperts.place({0: stacks}, {0: []}, torch.device("cpu"), swiglu_limit=7.0)
    x = torch.randn(1, D).to(torch.bfloat16)
    weights = torch.full((1, TOP_K), 1.0 / TOP_K)
    steps = [torch.randperm(args.experts, generator=gen)[:TOP_K].unsqueeze(0) for _ in range(args.steps + 2)]
    for ids in steps[:2]:
        hybrid(0, x, ids, weights)
    seconds = sum(timed(lambda ids=ids: hybrid(0, x, ids, weights)) for ids in steps[2:]) / args.steps
    moved = TOP_K * expert_nbytes(stacks)
    read = read_bandwidth(2 << 30)
    result = {"threads": torch.get_num_threads(), "format": args.format, "batch": 1, "top_k": TOP_K,
              "step_ms": seconds * 1e3, "bytes_per_step": moved, "executor_GBps": moved / seconds / 1e9,
              "read_GBps": read, "ratio": moved / seconds / 1e9 / read}
    if not args.json:
        print(f"executor: {result['executor_GBps']:.2f} GB/s ({seconds * 1e3:.2f} ms per token for {TOP_K} experts, "
              f"{moved / 2 ** 20:.1f} MiB); read: {read:.1f} GB/s on {result['threads']} threads")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
