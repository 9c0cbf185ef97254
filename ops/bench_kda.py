"""KDA hot ops per layer on one GPU, next to the HBM roofline.

Decode (`kda_decode`, one token for each of B requests): the fused Triton op, the torch reference,
and fla's `fused_recurrent_kda` kernel (the recurrence alone, on post-conv q/k/v with its in-kernel
norms/gate/beta, no conv and no output norm, so a lower bound for what it would cost in the op).
Each is timed as LAYERS back-to-back calls on separate per-layer states (as in the model, where 34
layers x 4 MiB per request cannot stay in L2), both captured in a CUDA graph (the serving path: no
Python or launch overhead) and eagerly; the Triton op is also timed at every (block_v, num_warps) in TILE_SWEEP.

Short spans (`kda_spans`, B requests adding L tokens each, a cached turn's shape): the Triton recurrence
against the chunked path (ragged conv, gates, fla's chunk_kda, gated norm), eagerly as a prefill step runs
them, so a path's host time counts where the device would wait for it.

Prefill (`kda_prefill`, one sequence of N tokens): fla's chunk_kda (after warm_up_kda_prefill, so
no autotuning is timed) against the torch reference, eagerly, as the engine runs it.

    python -m ops.bench_kda                       # B=1,8 decode; 1x16/8x50/1x128 spans; 512/2048/8192 prefill
    python -m ops.bench_kda --json kda.json
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable

import torch

from engine.kernels.kda import fla_prefill, torch_ref, triton_decode, triton_spans
from engine.weights import DenseWeight
from ops.bench_engine import copy_bandwidth

CONV = 4
RANK = 128  # the gates' low-rank width in the release
LOWER_BOUND, EPS = -5.0, 1e-5
TILE_SWEEP = [(16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8)]  # (block_v, num_warps)


def per_call_us(calls: list[Callable[[], Any]], reps: int, graph: bool) -> float:
    """Mean microseconds per call of `calls` run back to back, replayed `reps` times."""
    for call in calls:  # compile, autotune and allocate outside the timing (and the capture)
        call()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(cuda_graph, stream=stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)

        def run() -> None:
            cuda_graph.replay()
    else:
        def run() -> None:
            for call in calls:
                call()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def decode_layers(b: int, layers: int, heads: int, dim: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """kda_decode arguments per layer: own states and parameters, shared activations (hot in L2 in the model)."""
    p = heads * dim
    shared = {"qkv": torch.randn(b, 3 * p, device="cuda", dtype=dtype),
              "forget_low": torch.randn(b, RANK, device="cuda", dtype=dtype),
              "beta_logits": torch.randn(b, heads, device="cuda", dtype=dtype),
              "gate_low": torch.randn(b, RANK, device="cuda", dtype=dtype),
              "slots": torch.randperm(b, device="cuda"), "lower_bound": LOWER_BOUND, "eps": EPS}
    return [{**shared, "f_b": up_projection(p, dtype), "g_b": up_projection(p, dtype),
             "conv_state": torch.randn(b, 3 * p, CONV - 1, device="cuda", dtype=dtype),
             "conv_weight": torch.randn(3 * p, CONV, device="cuda") * 0.5,
             "rec_state": torch.randn(b, heads, dim, dim, device="cuda") * 0.1,
             "decay_rate": torch.rand(heads, device="cuda") + 0.5, "dt_bias": torch.randn(p, device="cuda"),
             "o_norm": torch.ones(dim, device="cuda", dtype=dtype)} for _ in range(layers)]


def up_projection(p: int, dtype: torch.dtype) -> DenseWeight:
    """A gate's low-rank up-projection [P, RANK], as the release stores it (16-bit, dense)."""
    return DenseWeight((torch.randn(p, RANK, device="cuda") * RANK ** -0.5).to(dtype))


def fla_recurrence(args: dict[str, Any], heads: int, dim: int) -> Callable[[], Any]:
    """fla's decode kernel as vLLM calls it: states in place at `slots`, gate/beta/norms in the kernel."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    b = args["qkv"].shape[0]
    q, k, v = (x.reshape(b, 1, heads, dim) for x in args["qkv"].chunk(3, dim=-1))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    f = args["forget_low"] @ args["f_b"].data.t()  # fla takes the projected gate
    g, beta = f.view(b, 1, heads, dim), args["beta_logits"].view(b, 1, heads)
    a_log = args["decay_rate"].log()
    return lambda: fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log=a_log, dt_bias=args["dt_bias"], initial_state=args["rec_state"],
        inplace_final_state=True, ssm_state_indices=args["slots"], use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)


def spans_args(b: int, n: int, heads: int, dim: int, dtype: torch.dtype) -> dict[str, Any]:
    """`kda_spans` arguments: b requests of n new tokens each, on their own slots."""
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda")

    p, rows = heads * dim, b * n
    return {"qkv": rnd(rows, 3 * p).to(dtype), "f": rnd(rows, p).to(dtype), "beta_logits": rnd(rows, heads).to(dtype),
            "gate_out": rnd(rows, p).to(dtype), "conv_state": rnd(b, 3 * p, CONV - 1).to(dtype),
            "conv_weight": rnd(3 * p, CONV) * 0.5, "rec_state": rnd(b, heads, dim, dim) * 0.1,
            "slots": torch.arange(b, device="cuda"), "cu_seqlens": torch.arange(b + 1, device="cuda") * n,
            "conv_rows": torch_ref.ConvRows.of([n] * b, CONV - 1, torch.device("cuda")), "longest": n,
            "decay_rate": rnd(heads).exp(), "dt_bias": rnd(p), "o_norm": (1 + 0.1 * rnd(dim)).to(dtype),
            "lower_bound": LOWER_BOUND, "eps": EPS}


def decode_bytes(b: int, heads: int, dim: int, elt: int) -> int:
    """Fewest bytes one layer's decode moves: fp32 state and conv state read + written, activations, params (the
    gates' up-projections among them)."""
    p = heads * dim
    states = 2 * b * (heads * dim * dim * 4 + 3 * p * (CONV - 1) * elt)
    activations = b * (3 * p + 2 * RANK + p + heads) * elt  # qkv, the gates' low-rank inputs, o, beta
    params = 3 * p * CONV * 4 + p * 4 + heads * 4 + dim * elt + 2 * p * RANK * elt
    return states + activations + params


def prefill_bytes(n: int, heads: int, dim: int, elt: int) -> int:
    p = heads * dim
    return n * (4 * p * elt + p * 4 + heads * elt) + 2 * heads * dim * dim * 4  # q,k,v,out; g; beta; state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=34, help="decode calls per timed pass (KDA layers)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--spans", default="1x16,8x50,1x128", help="short spans: requests x tokens each")
    parser.add_argument("--prefills", default="512,2048,8192")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    elt = torch.empty(0, dtype=dtype).element_size()
    h, d = args.heads, args.dim
    result: dict[str, Any] = {}

    def report(values: dict[str, Any]) -> None:
        """Print as soon as measured, so a later failure keeps the earlier figures."""
        result.update(values)
        for key, value in values.items():
            print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}", flush=True)

    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"), 4 << 30) * 1e9
    report({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "heads": h, "dim": d,
            "copy_bandwidth_gbs": bandwidth / 1e9})

    def time_decode(key: str, calls: list[Callable[[], Any]], graph: bool, roof_us: float) -> None:
        try:
            us = per_call_us(calls, args.reps, graph)
        except Exception as exc:  # one path failing must not hide the others' figures
            report({key: f"failed: {type(exc).__name__}: {exc}"})
            return
        report({key: us, f"{key}_ratio_to_roofline": us / roof_us})

    for b in [int(x) for x in args.batches.split(",") if x]:
        layers = decode_layers(b, args.layers, h, d, dtype)
        roof_us = decode_bytes(b, h, d, elt) / bandwidth * 1e6
        bv, warps = triton_decode.decode_launch_config(b, h, d)
        report({f"decode_b{b}_bytes_per_layer": decode_bytes(b, h, d, elt), f"decode_b{b}_roofline_us": roof_us,
                f"decode_b{b}_triton_block_v": bv, f"decode_b{b}_triton_num_warps": warps})
        impls = {"triton": [lambda a=a: triton_decode.kda_decode(**a) for a in layers],
                 "torch": [lambda a=a: torch_ref.kda_decode(**a) for a in layers],
                 "fla_recurrence_only": [fla_recurrence(a, h, d) for a in layers]}
        for name, calls in impls.items():
            for graph in (True, False):
                time_decode(f"decode_b{b}_{name}_{'graph' if graph else 'eager'}_us_per_layer", calls, graph, roof_us)
        for bv, warps in TILE_SWEEP:  # the data to retune decode_launch_config
            if d % bv == 0:
                calls = [lambda a=a, bv=bv, warps=warps: triton_decode.kda_decode(**a, block_v=bv, num_warps=warps)
                         for a in layers]
                time_decode(f"decode_b{b}_triton_bv{bv}_w{warps}_graph_us_per_layer", calls, True, roof_us)
        del layers, impls

    fla_prefill.warm_up_kda_prefill("cuda", h, d, dtype)
    for shape in [x for x in args.spans.split(",") if x]:
        b, n = (int(x) for x in shape.split("x"))
        spans = spans_args(b, n, h, d, dtype)
        for name, fn in (("triton", triton_spans.kda_spans), ("chunked", torch_ref.kda_spans)):
            us = per_call_us([lambda fn=fn: fn(**spans)], args.reps, graph=False)
            report({f"spans_{shape}_{name}_us_per_layer": us})
    for n in [int(x) for x in args.prefills.split(",") if x]:
        q, k, v = (torch.randn(n, h, d, device="cuda", dtype=dtype) for _ in range(3))
        g = LOWER_BOUND * torch.sigmoid(torch.randn(n, h, d, device="cuda"))
        beta = torch.sigmoid(torch.randn(n, h, device="cuda")).to(dtype)
        state = torch.randn(1, h, d, d, device="cuda") * 0.1
        slots, cu = torch.zeros(1, dtype=torch.long, device="cuda"), torch.tensor([0, n], device="cuda")
        roof_us = prefill_bytes(n, h, d, elt) / bandwidth * 1e6
        report({f"prefill{n}_bytes_per_layer": prefill_bytes(n, h, d, elt), f"prefill{n}_roofline_us": roof_us})
        for name, fn in (("fla", fla_prefill.kda_prefill), ("torch", torch_ref.kda_prefill)):
            reps = max(2, math.ceil(args.reps * 512 / n)) if name == "fla" else 2
            us = per_call_us([lambda fn=fn: fn(q, k, v, g, beta, state, slots, cu)], reps, graph=False)
            report({f"prefill{n}_{name}_us_per_layer": us, f"prefill{n}_{name}_tok_s": n / us * 1e6,
                    f"prefill{n}_{name}_ratio_to_roofline": us / roof_us})

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
