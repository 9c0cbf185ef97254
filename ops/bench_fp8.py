"""FP8 block kernels at the release's shapes: decode and prefill timings next to the device copy rate.

Routed experts (E 288, D 4096, I 2048, k 8) and the q_b_proj [16384, 1536] / o_proj [4096, 16384]
linears, at T = 1 and 8 (decode) and 2048 (prefill), each through:
  - the Triton path, timed eagerly and (decode) replayed from a CUDA graph, as the engine runs it;
  - the torch path (TorchExperts / dequantize + matmul), eagerly;
  - for the linears, cuBLAS bf16 on the pre-expanded weight: the dense ceiling.
Each figure reports ms per call, the bytes the call must read (the distinct routed experts, or the
whole linear weight) as GB/s and as a fraction of the device copy rate measured in the same run,
and TFLOP/s. Calls rotate over routings / weight copies larger than L2, so decode reads come from HBM.

    python -m ops.bench_fp8 [--json fp8.json]
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import triton

from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.fp8_block import fp8_block_moe
from engine.kernels.linear import torch_ref
from engine.kernels.linear.triton_linear import fp8_block_linear
from engine.weights import Fp8BlockWeight
from ops.bench_engine import copy_bandwidth

E, D, I, TOPK, LIMIT = 288, 4096, 2048, 8, 10.0
LINEARS = {"q_b_proj": (16384, 1536), "o_proj": (4096, 16384)}
DECODE, PREFILL = (1, 8), 2048


def random_fp8(shape: tuple[int, ...], device: torch.device) -> Fp8BlockWeight:
    data = torch.randn(shape, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    blocks = (*shape[:-2], triton.cdiv(shape[-2], 128), triton.cdiv(shape[-1], 128))
    return Fp8BlockWeight(data, torch.full(blocks, shape[-1] ** -0.5, device=device))


def eager_ms(calls: list[Callable[[], Any]], reps: int = 3) -> float:
    """Mean ms per call over `reps` passes through `calls`, after one warm pass."""
    for call in calls:
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for call in calls:
            call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * len(calls))


def graph_ms(calls: list[Callable[[], Any]], reps: int = 10) -> float:
    """Mean ms per call of one CUDA graph holding every call, replayed `reps` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * len(calls))


@contextmanager
def torch_kernels() -> Iterator[None]:
    """The reference path everywhere (TorchExperts' linears dispatch on the tensors' device)."""
    old = os.environ.get("GLMFLASH_KERNELS")
    os.environ["GLMFLASH_KERNELS"] = "torch"
    try:
        yield
    finally:
        if old is None:
            del os.environ["GLMFLASH_KERNELS"]
        else:
            os.environ["GLMFLASH_KERNELS"] = old


def figure(ms: float, nbytes: float, flops: float, copy_gbs: float) -> dict[str, float]:
    gbs = nbytes / ms / 1e6
    return {"ms": round(ms, 4), "GB/s": round(gbs, 1), "of_copy": round(gbs / copy_gbs, 3),
            "TFLOP/s": round(flops / ms / 1e9, 2)}


def bench_experts(device: torch.device, copy_gbs: float, l2: int) -> dict[str, Any]:
    gate, up, down = random_fp8((E, I, D), device), random_fp8((E, I, D), device), random_fp8((E, D, I), device)
    per_expert = (gate.nbytes() + up.nbytes() + down.nbytes()) / E
    reference = TorchExperts({0: (gate, up, down)}, LIMIT)
    out: dict[str, Any] = {}
    for t in (*DECODE, PREFILL):
        routings = max(4, 4 * l2 // int(per_expert * TOPK)) if t in DECODE else 1
        cases = []
        for _ in range(routings):
            ids = torch.rand(t, E, device=device).topk(TOPK, dim=-1).indices
            w = torch.softmax(torch.randn(t, TOPK, device=device), -1)
            cases.append((torch.randn(t, D, device=device, dtype=torch.bfloat16), ids, w))
        nbytes = sum(ids.unique().numel() for _, ids, _ in cases) / len(cases) * per_expert
        flops = 2 * t * TOPK * 3 * D * I
        triton_calls = [lambda c=c: fp8_block_moe(*c, gate, up, down, LIMIT) for c in cases]
        torch_calls = [lambda c=c: reference(0, *c) for c in cases]
        row = {"distinct_experts": round(nbytes / per_expert, 1),
               "triton": figure(eager_ms(triton_calls), nbytes, flops, copy_gbs)}
        if t in DECODE:
            row["triton_graph"] = figure(graph_ms(triton_calls), nbytes, flops, copy_gbs)
        with torch_kernels():
            row["torch"] = figure(eager_ms(torch_calls[:4], reps=1), nbytes, flops, copy_gbs)
        out[f"T={t}"] = row
    return out


def bench_linear(name: str, device: torch.device, copy_gbs: float, l2: int) -> dict[str, Any]:
    n, k = LINEARS[name]
    probe = random_fp8((n, k), device)
    weights = [probe] + [random_fp8((n, k), device) for _ in range(max(0, 4 * l2 // probe.nbytes()))]
    dense = [w.dequantize(torch.bfloat16) for w in weights[:2]]
    out: dict[str, Any] = {}
    for t in (*DECODE, PREFILL):
        x = torch.randn(t, k, device=device, dtype=torch.bfloat16)
        nbytes, flops = probe.nbytes() + 2 * t * (n + k), 2 * t * n * k
        row = {"triton": figure(eager_ms([lambda w=w: fp8_block_linear(x, w) for w in weights]), nbytes, flops,
                                copy_gbs)}
        if t in DECODE:
            row["triton_graph"] = figure(graph_ms([lambda w=w: fp8_block_linear(x, w) for w in weights]), nbytes,
                                         flops, copy_gbs)
        row["torch"] = figure(eager_ms([lambda w=w: torch_ref.linear(x, w) for w in weights]), nbytes, flops,
                              copy_gbs)
        row["cublas_bf16"] = figure(eager_ms([lambda w=w: x @ w.t() for w in dense]), 2 * n * k, flops, copy_gbs)
        out[f"T={t}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_gbs = copy_bandwidth(device, 2 << 30)
    result: dict[str, Any] = {"device": props.name, "copy_GB/s": round(copy_gbs, 1),
                              "experts": bench_experts(device, copy_gbs, props.L2_cache_size)}
    for name in LINEARS:
        result[name] = bench_linear(name, device, copy_gbs, props.L2_cache_size)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
