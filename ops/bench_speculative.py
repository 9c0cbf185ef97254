"""Speculative decoding's cost side, through `LLM.generate` (wall clock): decode tok/s without drafts, with the MTP
layer drafting but nothing verified (the drafting's cost), and with drafts verified at forced acceptance rates.

Random synthetic weights make the MTP layer's own drafts almost never right, so each verify-step run replaces the
drafts, after the MTP layer made them, by the token decoding without drafts gives (known from a first run) with
probability `a`, else by a wrong one: the step costs are the real ones (the MTP layer still runs, every verify
step still runs its drafts' rows), the acceptance (each draft right with probability a) is chosen. Reported per
batch size: decode ms a step (from decode graphs where they are captured, and eager), the drafting's cost (the MTP
layer, nothing verified, against decode: the main model's step still replays its graph), and for each draft length
k the step's cost against a decode step (at acceptance 0: every step one token, so drafting k tokens plus a verify
of k + 1 rows a request, replayed from the verify graphs) and tok/s at each acceptance (targets: a k = 1 step at
most 1.15x a decode step on a resident slice, the drafting at most 0.15x), with the acceptance the verify steps
reached and the share of tokens equal to plain decoding's (the run stops on any difference in float32).

    python -m ops.bench_speculative --device cuda --layers 8 --batches 1,4 --drafts 1,2,3 --tokens 64 [--json OUT]
    python -m ops.bench_speculative --device cuda --layers 45 --expert-slots auto --batches 1,4 --drafts 1,2,3
    python -m ops.bench_speculative --device cpu --tiny --tokens 8     # smoke run on the tiny model's shapes
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.mtp_drafter import MtpDrafter
from engine.options import EngineOptions
from engine.step_plan import StepPlan
from engine.tiny.factory import synthetic_weights, tiny_config
from ops.bench_decode import auto_slots, weight_bytes
from ops.bench_engine import slice_text_config, sync

ACCEPTANCE = (0.0, 0.5, 0.7, 0.9, 1.0)


def forcing_step(truth: dict[tuple[int, ...], list[int]], right: float, vocab: int,
                 seed: int = 0) -> Callable[[MtpDrafter, StepPlan], None]:
    """An `MtpDrafter.draft` that, after the MTP layer drafted, replaces each draft by the right token (the one
    decoding without drafts gives for that request and position, from `truth`: prompt -> output) with
    probability `right`, else by a wrong one (drafts past the known answer are dropped)."""
    rng = random.Random(seed)
    original = MtpDrafter.draft

    def draft(self: MtpDrafter, plan: StepPlan) -> None:
        original(self, plan)
        for span in plan.spans:
            seq = span.seq
            answer = truth.get(tuple(seq.prompt_token_ids), [])
            position = len(seq.output_token_ids)
            seq.draft_tokens = tuple(answer[i] if rng.random() < right else (answer[i] + 1) % vocab
                                     for i in range(position, min(position + len(seq.draft_tokens), len(answer))))

    return draft


@contextmanager
def forced_drafts(truth: dict[tuple[int, ...], list[int]], right: float, vocab: int) -> Iterator[None]:
    """`forcing_step` in place within the block."""
    original, MtpDrafter.draft = MtpDrafter.draft, forcing_step(truth, right, vocab)
    try:
        yield
    finally:
        MtpDrafter.draft = original


def config(args: argparse.Namespace) -> ModelConfig:
    text = dict(tiny_config(args.format)["text_config"]) if args.tiny else slice_text_config(args.layers)
    text["num_nextn_predict_layers"] = 1
    return ModelConfig.from_dict({"text_config": text, "quantization_config": tiny_config(args.format).get(
        "quantization_config")})


def timed_generate(llm: LLM, prompts: list[list[int]], tokens: int, device: torch.device) -> tuple[float, list]:
    """Seconds of the decode steps (a run to `tokens` less a run to one token, the prefill's) and the outputs."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    outputs = None
    for p in (first, params):
        sync(device)
        start = time.perf_counter()
        out = llm.generate(prompts, p)
        sync(device)
        times.append(time.perf_counter() - start)
        outputs = out
    return times[1] - times[0], outputs


@contextmanager
def engine_mode(llm: LLM, drafts: int | None, graphs: bool = True) -> Iterator[None]:
    """One engine run as plain decoding (`drafts` None: no MTP layer), drafting only (0: one draft a step, none
    verified) or verifying k drafts a step; with its decode graphs or eager (`graphs`). Between runs, so no
    request is in flight."""
    core, runner = llm.core, llm.runner
    drafter, captured = core.drafter, runner.graphs
    speculative = drafter.k
    core.drafter = None if drafts is None else drafter
    drafter.k = drafter.k_now = speculative if drafts is None else drafts
    runner.graphs = captured if graphs else None
    try:
        yield
    finally:
        core.drafter, runner.graphs, drafter.k, drafter.k_now = drafter, captured, speculative, speculative


def agreement(got: list[list[int]], truth: list[list[int]]) -> float:
    """The share of tokens equal to plain decoding's up to each request's first departure. In bf16 a draft's rows
    change the prompt's chunk bounds and the GEMMs' shapes, so a near-tie between two tokens can resolve the
    other way (tests/gpu/test_speculative_cuda.py bounds such departures); in float32 every token is equal."""
    same = 0
    for a, b in zip(got, truth):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / sum(len(t) for t in truth)


def verify_replays(llm: LLM) -> int:
    """Verify steps replayed from graphs so far (none without graphs)."""
    graphs = llm.runner.graphs
    return 0 if graphs is None else sum(count for (_, n), count in graphs.replays.items() if n > 1)


def build_engine(args: argparse.Namespace, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
                 ) -> tuple[LLM, dict[str, Any]]:
    """The one engine every mode runs (speculative_tokens: the largest k), resident or under hybrid offload
    (`--expert-slots`, the MTP layer's experts placed like the others'); and what its placement was."""
    options = dict(prefix_cache=False, max_num_seqs=max(args.batches), max_model_len=args.prompt + args.tokens + 16,
                   speculative_tokens=max(args.drafts), measured_draft_length=False)
    slots, placement = None, {}
    if args.expert_slots is not None:
        memory = EngineOptions(max_num_batched_tokens=2048, **options)
        slots = auto_slots(cfg, args.format, device, memory) if args.expert_slots == "auto" else int(args.expert_slots)
        placement = {"expert_slots_per_layer": slots}
    weights = synthetic_weights(cfg, args.format, device, dtype, expert_slots=slots, expert_variety=args.expert_variety)
    budget = None
    if slots is not None:
        budget = slots * round(weight_bytes(cfg, weights)[1]) * (len(cfg.moe_layers) + cfg.num_mtp_layers)
    return LLM.from_weights(cfg, weights, moe_vram_budget=budget, **options), placement


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = config(args)
    llm, placement = build_engine(args, cfg, device, dtype)
    g = torch.Generator().manual_seed(0)
    warm = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(max(args.batches))]
    for drafts in [None, 0, *args.drafts]:  # first-run costs (allocator, kernels at these shapes) out of the timings
        with engine_mode(llm, drafts):
            llm.generate(warm, SamplingParams(max_tokens=args.warm_tokens, temperature=0.0, ignore_eos=True))
    results, stats = [], llm.core.drafter.stats
    for batch in args.batches:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(batch)]
        with engine_mode(llm, None):
            decode_s, outputs = timed_generate(llm, prompts, args.tokens, device)
        with engine_mode(llm, None, graphs=False):
            eager_s, _ = timed_generate(llm, prompts, args.tokens, device)
        with engine_mode(llm, 0):
            drafting_s, _ = timed_generate(llm, prompts, args.tokens, device)
        truth = {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}
        steps = args.tokens - 1  # decode steps after the prefill's token, per request
        row = {"batch": batch, "decode_ms_per_step": decode_s / steps * 1e3,
               "decode_tok_s": batch * steps / decode_s, "eager_decode_ms_per_step": eager_s / steps * 1e3,
               "drafting_ms_per_step": drafting_s / steps * 1e3, "drafting_cost": (drafting_s - decode_s) / decode_s}
        for k in args.drafts:
            for a in args.acceptance:
                replayed, tried, took = verify_replays(llm), stats.verified, stats.verified_accepted
                with engine_mode(llm, k), forced_drafts(truth, a, cfg.vocab_size):
                    verify_s, got = timed_generate(llm, prompts, args.tokens, device)
                if a == 0.0:
                    row[f"k{k}_graph_verify_steps"] = verify_replays(llm) - replayed
                tried, took = stats.verified - tried, stats.verified_accepted - took
                row[f"k{k}_accepted_at_{a}"] = took / tried if tried else 0.0
                row[f"k{k}_same_tokens_at_{a}"] = same = agreement([o.token_ids for o in got], list(truth.values()))
                if dtype == torch.float32 and same != 1.0:  # exact arithmetic's order aside, tokens must be equal
                    raise SystemExit(f"batch {batch}, k {k}, acceptance {a}: verified output differs from plain "
                                     "decoding")
                row[f"k{k}_tok_s_at_{a}"] = batch * steps / verify_s
                if a == 0.0:  # every draft rejected: one token a step, so the step's own cost
                    row[f"k{k}_step_ms"] = verify_s / steps * 1e3
                    row[f"k{k}_step_cost"] = verify_s / decode_s
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        results.append(row)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "layers": cfg.num_layers,
            "format": args.format, "dtype": args.dtype, "tokens": args.tokens, "prompt": args.prompt,
            **placement, "results": results}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--format", default="nvfp4-ct", choices=["bf16", "fp8", "nvfp4-ct"])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the full-width slice")
    parser.add_argument("--tiny", action="store_true", help="the tiny model's shapes (CPU smoke run)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated a request")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens a request")
    parser.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                        help="draft lengths k to time")
    parser.add_argument("--acceptance", type=lambda s: [float(x) for x in s.split(",")], default=list(ACCEPTANCE))
    parser.add_argument("--expert-variety", type=int, default=8)
    parser.add_argument("--expert-slots", help="hybrid offload: routed experts a MoE layer keeps on the device "
                                               "(a number, or auto: what the memory plan leaves)")
    parser.add_argument("--warm-tokens", type=int, default=4, help="tokens of the warm-up run in each mode")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
