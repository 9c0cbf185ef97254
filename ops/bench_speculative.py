"""Speculative decoding's cost side, through `LLM.generate` (wall clock): decode tok/s without drafts, with the MTP
layer drafting but nothing verified (the drafting's cost), and with drafts verified: the MTP layer's own, then at
forced acceptance rates.

Random synthetic weights make the MTP layer's own drafts almost never right: a run with them gives the verify
step's cost (every step one token, or a few more where a draft held: the step time is the run's time over its
steps, from the mean accepted length) and, in float32, must give plain decoding's tokens exactly (the run stops
otherwise; in bf16 a draft's rows change the GEMMs' shapes, so a near-tie may resolve the other way: the share
of tokens equal up to each request's first departure is reported). Runs at acceptance `a` then replace the
engine's verdicts (`engine.sampler.verify_drafts`) by one that accepts each draft with probability a whatever the
logits say: every cost is the real one (the MTP layer drafts, the verify runs k + 1 rows a request, a rejection
restores the state), the acceptance is chosen, and the tokens are no longer the model's. Reported per batch size:
decode ms a step (from decode graphs where they are captured, and eager), the drafting's cost (the MTP layer,
nothing verified, against decode), and for each draft length k the step's cost against a decode step and tok/s
at each acceptance (targets: a k = 1 step at most 1.15x a decode step on a resident slice, the drafting at most
0.15x).

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
from typing import Any, Callable, Iterator, TypeVar

import torch

from engine import LLM, SamplingParams, engine_core
from engine.config import ModelConfig
from engine.mtp_drafter import DraftStats
from engine.options import EngineOptions
from engine.prefill_chunk import measured_prefill_rates
from engine.tiny.factory import synthetic_weights, unplaced_expert_layers
from ops.bench_decode import auto_plan, prefill_tok_s, weight_bytes
from ops.bench_engine import bench_config, sync

ACCEPTANCE = (0.5, 0.7, 0.9, 1.0)
T = TypeVar("T")


def forcing_verifier(right: float, vocab: int, seed: int = 0) -> Callable[..., list[list[int]]]:
    """An `engine.sampler.verify_drafts` for greedy requests that accepts each draft with probability `right`
    whatever the logits say (after taking each row's argmax, the real verdict's work): the accepted drafts, then
    the argmax at the first rejected draft's row (another token where it equals the draft) or after the last."""
    rng = random.Random(seed)

    def verify(rows: list[torch.Tensor], seqs: list, drafts: list[tuple[int, ...]]) -> list[list[int]]:
        out = []
        for row, draft in zip(rows, drafts):
            picks = row.argmax(dim=-1).tolist()
            accepted = next((j for j in range(len(draft)) if rng.random() >= right), len(draft))
            last = picks[accepted]
            if accepted < len(draft) and last == draft[accepted]:
                last = (last + 1) % vocab
            out.append([*draft[:accepted], last])
        return out

    return verify


@contextmanager
def forced_acceptance(right: float, vocab: int) -> Iterator[None]:
    """`forcing_verifier` in place of the engine's verdicts within the block."""
    original = engine_core.verify_drafts
    engine_core.verify_drafts = forcing_verifier(right, vocab)
    try:
        yield
    finally:
        engine_core.verify_drafts = original


def config(args: argparse.Namespace) -> ModelConfig:
    return bench_config(args.format, args.layers, args.tiny, mtp=True)


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


def verified_during(stats: DraftStats, run: Callable[[], T]) -> tuple[T, tuple[int, int, int]]:
    """`run()`'s result and what it added to the engine's counts: drafts verified, drafts accepted, verify steps."""
    before = stats.verified, stats.verified_accepted, stats.verify_steps
    result = run()
    after = stats.verified, stats.verified_accepted, stats.verify_steps
    return result, (after[0] - before[0], after[1] - before[1], after[2] - before[2])


def verify_replays(llm: LLM) -> int:
    """Verify steps replayed from graphs so far (none without graphs)."""
    graphs = llm.runner.graphs
    return 0 if graphs is None else sum(count for (_, n), count in graphs.replays.items() if n > 1)


def build_engine(args: argparse.Namespace, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
                 ) -> tuple[LLM, dict[str, Any]]:
    """The one engine every mode runs (speculative_tokens: the largest k), resident or under hybrid offload
    (`--expert-slots`: the MTP layer's experts placed like the others' where stored alike, else resident); and
    what its placement was."""
    longest = max(args.prompt + args.tokens, args.prefill + 1)
    options = dict(prefix_cache=False, max_num_seqs=max(args.batches), max_model_len=longest + 16,
                   speculative_tokens=max(args.drafts), measured_draft_length=False)
    slots, placement = None, {}
    if args.expert_slots == "auto":  # as a server plans it: the prefill chunk too, from the measured rates
        plan = auto_plan(cfg, args.format, device, EngineOptions(max_num_batched_tokens=2048, **options),
                         lambda: measured_prefill_rates(device))
        slots, options["max_prefill_tokens"] = plan.expert_slots, plan.prefill_tokens
        placement = {"expert_slots_per_layer": slots, "prefill_chunk_tokens": plan.prefill_tokens or 2048}
    elif args.expert_slots is not None:
        slots = int(args.expert_slots)
        placement = {"expert_slots_per_layer": slots}
    weights = synthetic_weights(cfg, args.format, device, dtype, expert_slots=slots, expert_variety=args.expert_variety)
    budget = None
    if slots is not None:
        placed = len(cfg.moe_layers) + cfg.num_mtp_layers - len(unplaced_expert_layers(cfg, args.format))
        budget = slots * round(weight_bytes(cfg, weights)[1]) * placed
    return LLM.from_weights(cfg, weights, moe_vram_budget=budget, **options), placement


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = config(args)
    llm, placement = build_engine(args, cfg, device, dtype)
    if llm.core.drafter is None:
        raise SystemExit("this engine drafts nothing: see its event=mtp_drafts line for the reason")
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
            replayed = verify_replays(llm)
            with engine_mode(llm, k):  # the MTP layer's own drafts: on random weights almost all rejected
                (verify_s, got), (tried, took, verifies) = verified_during(
                    stats, lambda: timed_generate(llm, prompts, args.tokens, device))
            row[f"k{k}_graph_verify_steps"] = verify_replays(llm) - replayed
            row[f"k{k}_own_acceptance"] = took / tried if tried else 0.0
            row[f"k{k}_same_tokens"] = same = agreement([o.token_ids for o in got], list(truth.values()))
            if dtype == torch.float32 and same != 1.0:  # exact arithmetic's order aside, tokens must be equal
                raise SystemExit(f"batch {batch}, k {k}: verified output differs from plain decoding")
            tokens_a_step = 1 + took / verifies if verifies else 1.0  # the mean accepted length
            row[f"k{k}_step_ms"] = verify_s / (steps / tokens_a_step) * 1e3
            row[f"k{k}_step_cost"] = row[f"k{k}_step_ms"] / row["decode_ms_per_step"]
            for a in args.acceptance:
                with engine_mode(llm, k), forced_acceptance(a, cfg.vocab_size):
                    (verify_s, _), (tried, took, _) = verified_during(
                        stats, lambda: timed_generate(llm, prompts, args.tokens, device))
                row[f"k{k}_accepted_at_{a}"] = took / tried if tried else 0.0
                row[f"k{k}_tok_s_at_{a}"] = batch * steps / verify_s
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        results.append(row)
    prefill = {}
    if args.prefill:  # the same engine: a whole model is built once for both
        with engine_mode(llm, None):
            prefill = {f"prefill{args.prefill}_tok_s": prefill_tok_s(llm, args.prefill, device)}
        print(" ".join(f"{k}={v:.1f}" for k, v in prefill.items()), flush=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "layers": cfg.num_layers,
            "format": args.format, "dtype": args.dtype, "tokens": args.tokens, "prompt": args.prompt,
            **placement, **prefill, "results": results}


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
    parser.add_argument("--prefill", type=int, default=0, help="after the table, prefill tok/s of one prompt this "
                        "long on the same engine (2,048-token chunks; 0: none)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
