"""CPU expert executor speed at the release's expert shapes, next to the host's read bandwidth.

Builds real-shape NVFP4 or FP8-block expert stacks (hidden 4096, expert width 2048; random codes and scales: the
executor's speed does not depend on their values) in host RAM and times the host step hybrid decode runs
per MoE layer (offload/host_steps.py, here in place as on a machine without a GPU) on batch-1 decode (one
token, top-8 misses), the case hybrid offload lives on. Its thread pool waits awake between calls as it
does on a GPU host where one is present (`--spin-us` sets it). The bank (2 GiB by
default) is several times the last-level cache, so the experts come from DRAM as they do in serving. In
the same run, on the same threads, a STREAM-style read (a sum over a buffer larger than the caches)
gives the ceiling. The host's read rate drifts while a run lasts (other tenants of a cloud host: 77-137 GB/s
seen within minutes on 16 cores), so the two alternate for `--rounds` rounds and each round's executor rate is
taken over the read rate beside it. Prints one JSON line: executor_GBps, read_GBps and ratio (the medians over
the rounds) and each round's ratio.

    python -m ops.bench_cpu_moe --json            # every core torch sees
    python -m ops.bench_cpu_moe --threads 2 --json
    python -m ops.bench_cpu_moe --format fp8 --json
    python -m ops.bench_cpu_moe --misses 2 --gap-us 300 --json   # a hybrid layer's share, idle between layers
    python -m ops.bench_cpu_moe --bank torch-pinned --json        # torch's pinned memory (4 KiB pages)
    python -m ops.bench_cpu_moe --pin --json                      # workers pinned to cores, as with a GPU
    GLMFLASH_CPU_KERNELS=avx512 python -m ops.bench_cpu_moe --json   # without the int16 NVFP4 path of AVX-512 VNNI
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.experts.hybrid import expert_nbytes
from engine.kernels.experts.cpu_gemv import ExpertStacks, pin_workers, simd_path
from engine.cpu_cores import worker_cpus
from engine.offload.host_memory import host_copy
from engine.offload.host_steps import SPIN_NS, HostSteps
from engine.weights import Fp8BlockWeight, Nvfp4Weight, map_tensors

D, I, TOP_K = 4096, 2048, 8


def nvfp4_stack(experts: int, n: int, k: int, gen: torch.Generator) -> Nvfp4Weight:
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(experts, n, k // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, torch.full((experts, 1), 1e-2))


def fp8_stack(experts: int, n: int, k: int, gen: torch.Generator) -> Fp8BlockWeight:
    data = torch.randint(0, 256, (experts, n, k), dtype=torch.uint8, generator=gen)
    data[(data & 0x7F) == 0x7F] = 0  # the two NaN bytes never occur in a checkpoint
    return Fp8BlockWeight(data.view(torch.float8_e4m3fn), torch.rand(experts, n // 128, k // 128, generator=gen) / 64)


BANKS = {
    "host": lambda t: host_copy(t, pin=torch.cuda.is_available()),
    "torch": lambda t: t.clone(),
    "torch-pinned": lambda t: t.pin_memory(),
}


def read_bandwidth(buf: torch.Tensor, reps: int = 5) -> float:
    """GB/s of a summing read over `buf` (beyond the caches), the best of `reps`."""
    buf.sum()
    best = min(timed(buf.sum) for _ in range(reps))
    return buf.numel() * buf.element_size() / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--format", default="nvfp4", choices=["nvfp4", "fp8"])
    parser.add_argument("--experts", type=int, default=160, help="experts in the host bank (2 GiB: beyond the "
                                                                 "caches, and consecutive steps read different ones)")
    parser.add_argument("--misses", type=int, default=TOP_K, help="experts one call runs (a decode step's misses)")
    parser.add_argument("--gap-us", type=float, default=0.0, help="idle time between calls (the device's share of "
                                                                  "a layer), in which the threads may fall asleep")
    parser.add_argument("--bank", default="host", choices=list(BANKS), help="where the bank lives: host bank memory "
                        "(huge pages, pinned with a GPU), torch's pageable or torch's pinned memory")
    parser.add_argument("--spin-us", type=float, help="how long the pool's threads wait awake after a call "
                        "(default: as the engine sets it here, awake with a GPU, asleep at once without)")
    parser.add_argument("--pin", action="store_true", help="pin the pool's workers to one core each, as the engine "
                        "does with a GPU (engine/offload/cpu_cores.py picks the cores)")
    parser.add_argument("--steps", type=int, default=40, help="calls timed per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of calls, each next to a read of its own")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    make = nvfp4_stack if args.format == "nvfp4" else fp8_stack
    stacks = tuple(map_tensors(make(args.experts, n, k, gen), BANKS[args.bank])
                   for n, k in ((I, D), (I, D), (D, I)))
    host = HostSteps({0: ExpertStacks(*stacks)}, {0: torch.arange(args.experts)}, args.misses, 7.0,
                     torch.get_num_threads(), torch.device("cpu"), max_rows=1)
    host.spin_ns = int(args.spin_us * 1e3) if args.spin_us is not None else SPIN_NS * torch.cuda.is_available()
    pinned = worker_cpus(torch.get_num_threads()) if args.pin else []
    pin_workers(pinned)
    x = torch.randn(1, D).to(torch.bfloat16)
    weights = torch.full((1, args.misses), 1.0 / args.misses)
    for _ in range(2):  # compiles, page faults, the pool's threads
        host.run(0, x, torch.randperm(args.experts, generator=gen)[:args.misses].unsqueeze(0), weights)
    moved = args.misses * expert_nbytes(stacks)
    buf = torch.ones((2 << 30) // 4)
    rates, reads = [], []
    for _ in range(args.rounds):
        seconds = 0.0
        for _ in range(args.steps):
            ids = torch.randperm(args.experts, generator=gen)[:args.misses].unsqueeze(0)
            seconds += timed(lambda ids=ids: host.run(0, x, ids, weights))
            time.sleep(args.gap_us / 1e6)
        rates.append(moved * args.steps / seconds / 1e9)
        reads.append(read_bandwidth(buf))
    ratios = [rate / read for rate, read in zip(rates, reads)]
    rate = statistics.median(rates)
    result = {"threads": torch.get_num_threads(), "format": args.format, "bank": args.bank, "batch": 1,
              "simd_path": ["portable", "avx2", "avx512", "avx512vnni"][simd_path()],
              "misses": args.misses, "gap_us": args.gap_us, "spin_us": host.spin_ns / 1e3, "pinned": pinned,
              "step_ms": moved / rate / 1e6, "bytes_per_step": moved, "executor_GBps": rate,
              "read_GBps": statistics.median(reads), "ratio": statistics.median(ratios), "rounds": args.rounds,
              "round_ratios": [round(r, 3) for r in ratios]}
    if not args.json:
        print(f"executor: {rate:.2f} GB/s ({result['step_ms']:.2f} ms per call for {args.misses} experts, "
              f"{moved / 2 ** 20:.1f} MiB); read: {result['read_GBps']:.1f} GB/s on {result['threads']} threads; "
              f"ratio {result['ratio']:.2f} (medians of {args.rounds} rounds)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
