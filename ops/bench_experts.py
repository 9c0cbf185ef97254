"""Routed-expert kernels at GLM-5.3-Flash shapes: time, bytes read and bandwidth against the device copy rate.

Builds synthetic NVFP4 stacks (random codes and scales; 288 experts, D 4096, I 2048) for --layers MoE
layers and rotates the calls over them, so the 50 MB L2 never holds a layer's weights from the call
before. Decode (T = 1..16) replays a CUDA graph of --iters calls, as the engine runs decode; prefill
(T = 512, 2048) is timed per call. Both report the median over --repeats, next to TorchExperts (the
reference, timed per call) and the relative error between the two. Bytes read = distinct experts
routed x bytes per expert (codes, scales and global of gate, up and down, from the stacks); GB/s is
compared with a device-to-device copy measured in the same run (read + write counted).

    python ops/bench_experts.py [--json out.json] [--decode-tiles '{"gate_up_n": 16}']
    python ops/bench_experts.py --device cpu --tiny    # smoke test: Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

REAL = dict(hidden=4096, inter=2048, experts=288, topk=8)
TINY = dict(hidden=64, inter=32, experts=8, topk=4)


@dataclass
class Case:
    path: str
    tokens: int
    experts_read: int
    bytes: int
    triton_us: float
    gbps: float
    of_copy: float
    torch_us: float
    rel_err: float
    tflops: float  # the pairs' multiply-adds (gate, up and down) over the Triton time


def synthetic_layer(hidden: int, inter: int, experts: int, device: str, weights: str = "nvfp4") -> tuple:
    """gate, up, down stacks: NVFP4 (random codes, e4m3 scales in [0.5, 4), one global per expert) or those
    dequantized to bf16 (the kernels' dense path: what the GEMMs cost without the dequantization)."""
    from engine.weights import DenseWeight, Nvfp4Weight

    def stack(rows: int, cols: int) -> Nvfp4Weight:
        packed = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device)
        # e4m3 bytes 0x30..0x47 are 0.5 .. 3.75
        scale = torch.randint(0x30, 0x48, (experts, rows, cols // 16), dtype=torch.uint8, device=device)
        return Nvfp4Weight(packed, scale.view(torch.float8_e4m3fn), torch.full((experts, 1), 1e-3, device=device))

    stacks = stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)
    if weights == "nvfp4":
        return stacks
    # One expert at a time: each has its own global, and the fp32 transient stays one expert's size.
    return tuple(DenseWeight(torch.stack([w[e].dequantize(torch.bfloat16) for e in range(experts)]))
                 for w in stacks)


def routing(tokens: int, experts: int, topk: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    weights, ids = scores.topk(topk, dim=1)
    return ids, (weights / weights.sum(1, keepdim=True)).float()


class Clock:
    """Elapsed seconds of fn(), with CUDA events on a GPU (no host sync inside the timed span)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def copy_gbps(device: str, clock: Clock, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(clock(lambda: dst.copy_(src)) for _ in range(repeats)) / 1e9


def per_call(clock: Clock, device: str, calls: list[Callable[[], torch.Tensor]], iters: int, repeats: int,
             graph: bool) -> float:
    """Median seconds per call, cycling through `calls`; decode on a GPU replays them from one CUDA graph."""
    if graph and device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:  # compile and warm up outside the capture
                call()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for i in range(iters):
                calls[i % len(calls)]()
        cuda_graph.replay()
        return statistics.median(clock(cuda_graph.replay) for _ in range(repeats)) / iters
    for call in calls:
        call()
    return statistics.median(clock(calls[i % len(calls)]) for i in range(repeats))


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        # Triton kernels run on CPU tensors only in the interpreter, which must be on before they are defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from engine.experts import TorchExperts, TritonExperts
    from engine.kernels.experts import DecodeTiles, PrefillTiles

    dims = TINY if args.tiny else REAL
    layers = {i: synthetic_layer(dims["hidden"], dims["inter"], dims["experts"], args.device, args.weights)
              for i in range(args.layers)}
    expert_bytes = sum(w[0].nbytes() for w in layers[0])
    triton_experts = TritonExperts(layers, 10.0, decode_tiles=DecodeTiles(**json.loads(args.decode_tiles)),
                                   prefill_tiles=PrefillTiles(**json.loads(args.prefill_tiles)))
    torch_experts = TorchExperts(layers, 10.0)
    clock = Clock(args.device)
    copy = copy_gbps(args.device, clock, args.copy_mib << 20, args.repeats)
    cases = []
    for path, token_counts in (("decode", args.decode), ("prefill", args.prefill)):
        for tokens in token_counts:
            x = torch.randn(tokens, dims["hidden"], device=args.device).to(torch.bfloat16)
            ids, weights = routing(tokens, dims["experts"], dims["topk"], args.device, seed=tokens)
            if (path == "decode") != (ids.numel() <= triton_experts.decode_max_pairs):
                raise SystemExit(f"T={tokens} would not take the {path} path")
            calls = [lambda layer=layer: triton_experts(layer, x, ids, weights) for layer in layers]
            seconds = per_call(clock, args.device, calls, args.iters, args.repeats, graph=path == "decode")
            reference = [lambda layer=layer: torch_experts(layer, x, ids, weights) for layer in layers]
            torch_seconds = per_call(clock, args.device, reference, args.iters, min(args.repeats, 5), graph=False)
            got, want = triton_experts(0, x, ids, weights).float(), torch_experts(0, x, ids, weights).float()
            read = ids.unique().numel() * expert_bytes
            gbps = read / seconds / 1e9
            cases.append(Case(path, tokens, ids.unique().numel(), read, seconds * 1e6, gbps, gbps / copy,
                              torch_seconds * 1e6, ((got - want).norm() / want.norm()).item(),
                              6 * ids.numel() * dims["hidden"] * dims["inter"] / seconds / 1e12))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    return {"device": name, "dims": dims, "weights": args.weights, "layers": args.layers, "expert_bytes": expert_bytes,
            "copy_gbps": copy, "cases": [vars(c) for c in cases]}


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (D 64, I 32, 8 experts, top-4)")
    parser.add_argument("--layers", type=int, default=2, help="layers of stacks to rotate over (>= 2 defeats L2)")
    parser.add_argument("--decode", type=_ints, help="decode token counts (default 1,2,4,8,16; tiny: 1,3)")
    parser.add_argument("--prefill", type=_ints, help="prefill token counts (default 512,2048; tiny: 40)")
    parser.add_argument("--iters", type=int, default=20, help="decode calls per CUDA graph replay")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--weights", default="nvfp4", choices=["nvfp4", "bf16"],
                        help="bf16: the same experts dequantized (the GEMMs without the dequantization)")
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--decode-tiles", default="{}", help="JSON overrides of DecodeTiles fields")
    parser.add_argument("--prefill-tiles", default="{}", help="JSON overrides of PrefillTiles fields")
    parser.add_argument("--json", help="also write the results to this path")
    args = parser.parse_args(argv)
    args.decode = args.decode or ([1, 3] if args.tiny else [1, 2, 4, 8, 16])
    args.prefill = args.prefill or ([40] if args.tiny else [512, 2048])
    if args.layers < 2 and not args.tiny:
        parser.error("--layers must be >= 2 so that L2 does not hold the weights between calls")
    result = run(args)
    print(f"{result['device']}: {result['weights']} experts, copy {result['copy_gbps']:.1f} GB/s, "
          f"{result['expert_bytes'] / 1e6:.2f} MB per expert")
    print(f"{'path':8} {'T':>5} {'experts':>7} {'MB':>9} {'triton us':>10} {'GB/s':>7} {'of copy':>7} "
          f"{'torch us':>10} {'rel err':>8} {'TFLOP/s':>8}")
    for c in result["cases"]:
        print(f"{c['path']:8} {c['tokens']:5d} {c['experts_read']:7d} {c['bytes'] / 1e6:9.1f} {c['triton_us']:10.1f} "
              f"{c['gbps']:7.0f} {c['of_copy']:7.1%} {c['torch_us']:10.1f} {c['rel_err']:8.1e} {c['tflops']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
