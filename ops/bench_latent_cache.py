"""The DSA latent cache in fp8 against the activations' dtype, through `LLM.generate` and `LLM.prompt_logits`.

accuracy: a prompt and the greedy tokens the unquantized cache generates after it (the reference sequence); over
    its generated positions, the logits of each cache read against each other (max and mean |difference|, mean KL,
    top-1 agreement with the same context), and each cache's own greedy run (the first position where the fp8
    run departs, the share of equal tokens). With float32 activations the same figures for bf16 activations over
    the unquantized cache are the yardstick: serving in bf16 costs that much already. The tiny model is its
    well-conditioned variant (the default one turns any rounding into other tokens within a few steps); a slice
    at the release's shapes has synthetic random weights, so its greedy runs are as chaotic (say so with them).
context: for each cache, batch-1 decode tok/s after a prompt of each context length (the second and third runs
    of the prompt hit the prefix cache, so prefill cancels: (steps) / (t(2 + steps) - t(2))), the first run's
    prefill time, and the memory plan's bytes a token and the most context the device holds; on a slice or the
    whole model (hybrid offload with --expert-slots auto).

    python -m ops.bench_latent_cache accuracy --tiny --tokens 2048                       # CPU, float32
    python -m ops.bench_latent_cache accuracy --device cuda --layers 4 --tokens 2048      # release shapes, bf16
    python -m ops.bench_latent_cache context --device cuda --layers 8 --contexts 1024,32768,131072
    python -m ops.bench_latent_cache context --device cuda --layers 45 --expert-slots auto --contexts 1024,131072
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.options import EngineOptions
from engine.tiny.factory import synthetic_weights, write_tiny_model
from ops.bench_decode import auto_plan, prompts, timed, weight_bytes
from ops.bench_engine import bench_config

CACHES = ("auto", "fp8")


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def slice_engine(args: argparse.Namespace, kv_cache_dtype: str, dtype: torch.dtype, **options: Any) -> LLM:
    """An engine over synthetic weights of a release-shape slice (built anew: hybrid offload takes the host's
    experts out of the weights it is given); the whole model's experts placed by the memory plan's budget."""
    device = torch.device(args.device)
    cfg = bench_config(args.format, args.layers)
    options = dict(kv_cache_dtype=kv_cache_dtype, **options)
    slots = None
    if args.expert_slots is not None:
        slots = auto_plan(cfg, args.format, device, EngineOptions(**options)).expert_slots \
            if args.expert_slots == "auto" else int(args.expert_slots)
    weights = synthetic_weights(cfg, args.format, device, dtype, expert_slots=slots, expert_variety=args.expert_variety)
    budget = None if slots is None else slots * round(weight_bytes(cfg, weights)[1]) * len(cfg.moe_layers)
    return LLM.from_weights(cfg, weights, moe_vram_budget=budget, **options)


def engine(args: argparse.Namespace, kv_cache_dtype: str, dtype: str, **options: Any) -> LLM:
    if args.tiny:
        return LLM(args.tiny_dir, device=args.device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, **options)
    return slice_engine(args, kv_cache_dtype, getattr(torch, dtype), **options)


def logit_figures(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """`got` against `want` [positions, vocab], both read as fp32."""
    got, want = got.float(), want.float()
    error = (got - want).abs()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none")
    return {"max_abs": error.max().item(), "mean_abs": error.mean().item(), "mean_kl": kl.sum(-1).mean().item(),
            "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def run_figures(got: list[int], want: list[int]) -> dict[str, float]:
    """A greedy run against the reference run: where it first departs and the share of equal tokens."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    return {"first_departure": first, "equal_share": sum(a == b for a, b in zip(got, want)) / len(want)}


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(prefix_cache=False, max_num_seqs=1, max_model_len=args.prompt + args.tokens + 16,
                   max_num_batched_tokens=max(2048, args.prompt + args.tokens + 1))
    prompt = prompts(1, args.prompt, 283 if args.tiny else 150000, seed=1)[0]
    reference = engine(args, "auto", args.dtype, **options)
    reference_run = reference.generate([prompt], greedy(args.tokens))[0].token_ids
    sequence = prompt + reference_run
    generated = slice(len(prompt) - 1, len(sequence) - 1)  # the rows that chose the generated tokens
    want = reference.prompt_logits(sequence)[generated]
    del reference
    report: dict[str, Any] = {"prompt": args.prompt, "tokens": args.tokens, "dtype": args.dtype}
    runs = [("fp8", args.dtype)] + ([("auto", "bfloat16")] if args.dtype == "float32" else [])
    for cache, dtype in runs:  # the fp8 cache; bf16 activations over the unquantized cache, the yardstick
        llm = engine(args, cache, dtype, **options)
        name = "fp8_cache" if cache == "fp8" else "bf16_activations"
        report[name] = {**logit_figures(llm.prompt_logits(sequence)[generated], want),
                        **run_figures(llm.generate([prompt], greedy(args.tokens))[0].token_ids, reference_run)}
        print(json.dumps({name: report[name]}), flush=True)
        del llm
        gc.collect()
    return report


def context(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    longest = max(args.contexts)
    options = dict(prefix_cache=True, max_num_seqs=1, max_model_len=longest + args.tokens + 16,
                   max_num_batched_tokens=args.chunk)
    rows = []
    for cache in args.caches:
        llm = engine(args, cache, args.dtype, **options)
        plan = llm.core.plan
        for length in args.contexts:
            prompt = prompts(1, length, llm.config.vocab_size, seed=length)[0]
            prefill_s = timed(lambda: llm.generate([prompt], greedy(1)), device)
            timed(lambda: llm.generate([prompt], greedy(2 + args.tokens)), device)  # warm: every decode shape
            short = timed(lambda: llm.generate([prompt], greedy(2)), device)
            long = timed(lambda: llm.generate([prompt], greedy(2 + args.tokens)), device)
            rows.append({"cache": cache, "context": length, "prefill_s": prefill_s, "prefill_tok_s": length / prefill_s,
                         "decode_tok_s": args.tokens / (long - short), "context_token_bytes": plan.context_token_bytes,
                         "most_context_tokens": plan.most_context_tokens})
            print(json.dumps(rows[-1]), flush=True)
        del llm, plan
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:  # decode at each context against decode at the shortest, same cache
        base = next(r for r in rows if r["cache"] == row["cache"] and r["context"] == min(args.contexts))
        row["decode_vs_shortest"] = row["decode_tok_s"] / base["decode_tok_s"]
    return {"layers": "tiny" if args.tiny else args.layers, "dtype": args.dtype, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["accuracy", "context"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="activations (default: float32 on the CPU, bfloat16 on CUDA)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, well-conditioned (CPU runs)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the release-shape slice")
    parser.add_argument("--format", default="nvfp4-ct", choices=["bf16", "fp8", "nvfp4-ct"])
    parser.add_argument("--expert-slots", help="hybrid offload: routed experts a MoE layer keeps on the device "
                                               "(a number, or auto: what the memory plan leaves)")
    parser.add_argument("--expert-variety", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256, help="accuracy: prompt tokens")
    parser.add_argument("--tokens", type=int, default=2048, help="accuracy: tokens generated; context: decode steps")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 32768])
    parser.add_argument("--caches", type=lambda s: s.split(","), default=list(CACHES))
    parser.add_argument("--chunk", type=int, default=2048, help="context: max_num_batched_tokens")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            args.tiny_dir = write_tiny_model(Path(tmp), "bf16", 0, well_conditioned=True)
        report = accuracy(args) if args.what == "accuracy" else context(args)
    report["device"] = torch.cuda.get_device_name(args.device) if args.device == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
