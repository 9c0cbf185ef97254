"""mHC op speed on CUDA: the Triton kernels next to the torch path and the HBM roofline.

Ops: `mhc_pre` (the mix with its own reduction, the collapse and the sublayer's norm), `mhc_post` (the combine
alone) and `post_then_pre`, what a decode site costs in the model: the combine handed the next site's `fn` (which
at up to 16 tokens reduces for it as it writes the streams), then that site's mix from those partials.

Each op runs over 90 distinct sites (45 layers x 2, as in the release model) captured in one CUDA
graph, so every site reads its own `fn` from HBM and no launch gaps are timed: the figure is the
per-site cost inside a decode graph. The eager median of one call (triton.testing.do_bench, L2
flushed) is reported next to it. The roofline is the bytes an op must move once over the measured
device copy bandwidth.

    python -m ops.bench_mhc                      # bf16, T = 1, 8, 2048
    python -m ops.bench_mhc --dtype float32 --tokens 1,2048 --json /tmp/mhc.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import torch
import triton

from engine.kernels.mhc import torch_ref, triton_kernels
from ops.bench_engine import copy_bandwidth

S, D, EPS, HC_EPS, ITERS = 4, 4096, 1e-5, 1e-6, 20
SITES = 90
POOL_BYTES = 256 << 20  # streams buffers cycle through at least this much memory, well over the 50 MB L2

PRE = {"triton": triton_kernels.mhc_pre, "torch": torch_ref.mhc_pre}
POST = {"triton": triton_kernels.mhc_post, "torch": torch_ref.mhc_post}


def make_sites(t: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Per-site parameters and inputs; streams/out come from a pool large enough to defeat L2 reuse."""
    n, k = (2 + S) * S, S * D
    pool = min(SITES, max(2, triton.cdiv(POOL_BYTES, t * k * dtype.itemsize)))
    streams = [torch.randn(t, S, D, device="cuda", dtype=dtype) for _ in range(pool)]
    outs = [torch.randn(t, D, device="cuda", dtype=dtype) for _ in range(pool)]
    sites = []
    for i in range(SITES):
        fn = (2.0 * torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
        base, scale = torch.randn(n, device="cuda"), 0.5 + torch.rand(3, device="cuda")
        norm = (0.5 + torch.rand(D, device="cuda")).to(dtype)
        _, post, comb = torch_ref.mhc_pre(streams[i % pool], fn, base, scale, norm, EPS, HC_EPS, ITERS)
        sites.append({"streams": streams[i % pool], "out": outs[i % pool], "fn": fn, "base": base,
                      "scale": scale, "norm": norm, "post": post, "comb": comb})
    for i, site in enumerate(sites):
        site["next"] = sites[(i + 1) % SITES]
    return sites


def pre_call(impl: str, s: dict[str, Any]) -> Callable[[], Any]:
    return lambda: PRE[impl](s["streams"], s["fn"], s["base"], s["scale"], s["norm"], EPS, HC_EPS, ITERS)


def post_call(impl: str, s: dict[str, Any]) -> Callable[[], Any]:
    return lambda: POST[impl](s["streams"], s["out"], s["post"], s["comb"])


def post_then_pre_call(impl: str, s: dict[str, Any]) -> Callable[[], Any]:
    following = s["next"]

    def run() -> Any:
        streams, partials = POST[impl](s["streams"], s["out"], s["post"], s["comb"], following["fn"])
        return PRE[impl](streams, following["fn"], following["base"], following["scale"], following["norm"], EPS,
                         HC_EPS, ITERS, partials)
    return run


def graph_us_per_site(calls: list[Callable[[], Any]], replays: int = 10) -> float:
    """Median over replays of one graph holding every site's call, divided by the number of sites."""
    for call in calls:  # compile and warm the allocator outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def op_bytes(op: str, t: int, dtype: torch.dtype) -> int:
    """What the op must move at least once: fn + streams + norm in, normed collapse + post/comb out; or streams and
    the sublayer's output in, streams out; or both, the streams read once less."""
    act, mixes, row = t * S * D * dtype.itemsize, t * (S + S * S) * 4, t * D * dtype.itemsize
    pre = (2 + S) * S * S * D * dtype.itemsize + D * dtype.itemsize + act + row + mixes
    post = 2 * act + row + mixes
    return {"mhc_pre": pre, "mhc_post": post, "post_then_pre": pre + post - act}[op]


def bench(tokens: list[int], dtype: torch.dtype, copy_gbps: float) -> list[dict[str, Any]]:
    rows = []
    for t in tokens:
        sites = make_sites(t, dtype)
        for op, make in (("mhc_pre", pre_call), ("mhc_post", post_call), ("post_then_pre", post_then_pre_call)):
            nbytes = op_bytes(op, t, dtype)
            for impl in ("triton", "torch"):
                graph_us = graph_us_per_site([make(impl, s) for s in sites])
                eager_us = triton.testing.do_bench(make(impl, sites[0]), return_mode="median") * 1e3
                gbps = nbytes / graph_us / 1e3
                rows.append({"op": op, "tokens": t, "impl": impl, "graph_us": round(graph_us, 2),
                             "eager_us": round(eager_us, 2), "bytes": nbytes, "gbps": round(gbps, 1),
                             "of_copy_bw": round(gbps / copy_gbps, 3)})
                print(f"{op:13s} T={t:<5d} {impl:6s} graph {graph_us:9.2f} us/site   eager {eager_us:9.2f} us   "
                      f"{nbytes / 1e6:8.2f} MB  {gbps:7.1f} GB/s  {gbps / copy_gbps:6.1%} of copy")
        del sites
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,2048", help="comma-separated token counts")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mhc needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    copy_gbps = copy_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {copy_gbps:.0f} GB/s, {args.dtype}")
    rows = bench([int(x) for x in args.tokens.split(",")], dtype, copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "dtype": args.dtype,
                       "copy_gbps": round(copy_gbps, 1), "sites": SITES, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
