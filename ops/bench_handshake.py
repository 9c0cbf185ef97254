"""What one GPU<->CPU handshake of hybrid decode costs, per MoE layer, inside a CUDA graph.

Every hybrid MoE layer in a decode step writes the step's rows, ids and weights into pinned memory (one
kernel), forks a side stream, hands the CPU its share of the misses (a doorbell a listener thread answers,
or a CUDA host function) and copies its sum back, then joins. This times that round trip alone (with the
bookkeeping around it: routing counts, slot lookup): small NVFP4 experts, all routed pairs resident (the
host step finds no pair to run), `--layers` layers chained in one graph, against the same chain with the
device executor alone. Prints one JSON line: the step time of each and each handshake's microseconds per
layer. On a machine without a GPU the chains run eagerly and the host step inline (a smoke run: its
figure is no handshake).

    python -m ops.bench_handshake --device cuda --layers 42 --rows 1
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from engine.experts import executor_class
from engine.experts.hybrid import HybridExperts
from engine.offload.host_steps import HANDSHAKES
from ops.bench_cpu_moe import nvfp4_stack
from ops.bench_engine import sync

EXPERTS, HIDDEN, INTER, TOP_K = 17, 256, 128, 8  # the last expert lives in the host bank, never routed to


def chain(run: Callable, layers: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    """`layers` expert calls, each on the previous one's output (as layers follow each other in a step)."""
    def step() -> None:
        y = x
        for layer in range(layers):
            y = run(layer, y, ids, w)
    return step


def step_seconds(step: Callable[[], None], device: torch.device, reps: int) -> float:
    """Mean seconds of one chain: replayed from a CUDA graph on a GPU, eager elsewhere."""
    step()
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        step()
    sync(device)
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--rows", type=int, default=1, help="decode batch size")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    stacks = {layer: (nvfp4_stack(EXPERTS, INTER, HIDDEN, gen), nvfp4_stack(EXPERTS, INTER, HIDDEN, gen),
                      nvfp4_stack(EXPERTS, HIDDEN, INTER, gen)) for layer in range(args.layers)}
    resident = {layer: list(range(EXPERTS - 1)) for layer in stacks}
    executor = executor_class(device)
    x = torch.randn(args.rows, HIDDEN, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:TOP_K] for _ in range(args.rows)]).to(device)
    w = torch.rand(args.rows, TOP_K, generator=gen).to(device)
    result = {"device": args.device, "layers": args.layers, "rows": args.rows, "graphed": device.type == "cuda"}
    with torch.inference_mode():
        for handshake in HANDSHAKES:
            hybrid = HybridExperts.place(stacks, resident, device, 7.0, executor)
            hybrid.handshake = handshake
            hybrid.use_rows(args.rows)
            if "device_only_ms" not in result:
                base = step_seconds(chain(executor(hybrid.device_stacks, 7.0), args.layers, x, ids, w), device,
                                    args.reps)
                result["device_only_ms"] = base * 1e3
            both = step_seconds(chain(hybrid, args.layers, x, ids, w), device, args.reps)
            result[f"{handshake}_ms"] = both * 1e3
            result[f"{handshake}_us_per_layer"] = (both - base) / args.layers * 1e6
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
