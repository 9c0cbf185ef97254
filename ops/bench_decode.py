"""Decode and prefill speed through the public API on a full-width slice, next to the HBM roofline.

Builds the slice directly on the device (default: 8 layers in the release's 3:1 KDA:DSA pattern, all
MoE with 288 NVFP4 compressed-tensors experts, real vocab; synthetic weights in the real format),
then measures with wall clock through `LLM.generate` in one run:
  - the device copy bandwidth (the roofline's denominator);
  - batch-1 decode ms/token at 1k and 16k context, batch 4/8/16 step time at 1k context: the
    difference of two generate calls of different lengths over the same prompts, so prefill cancels;
  - prefill tokens/s at 512, 2,048 and 8,192 tokens (one request, max_tokens=1);
  - per layer the bytes a step reads (the distinct experts actually routed, counted in an untimed
    step) and the ratio of each figure to its roofline;
  - the transformers reference on the first 4 layers of the same weights, per layer, and our
    speed-up over it (`--reference-layers 0` skips it);
  - the extrapolation to 45 layers, labelled as one.

    python -m ops.bench_decode --device cuda               # the figures in ops/BENCHMARKS.md
    python -m ops.bench_decode --device cpu --tiny          # smoke run of the same code on the tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import time
from typing import Any, Callable

import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.model.moe import MoE
from engine.tiny.factory import synthetic_weights, unplaced_expert_layers
from engine.checkpoint.layout import EXPERT_KEY, EXPERT_PROJS, mtp_specs, quantized_in_release, text_specs
from engine.memory_plan import AUTO, MemoryPlan, WeightBytes, plan_memory, reserve_bytes
from engine.options import EngineOptions
from engine.prefill_chunk import PrefillRates, measured_prefill_rates
from ops.bench_cpu_moe import read_bandwidth
from ops.bench_engine import (FULL_LAYERS, bench_config, copy_bandwidth, device_kernels, nbytes, reference_model,
                              slice_text_config, sync, time_reference)

# Hybrid figures start once swaps have settled (see settle_swaps): a window of steps, and a cap on the warm-up.
SETTLE_WINDOW = 16
SETTLE_MAX_STEPS = 384


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 150000), (length,), generator=gen).tolist() for _ in range(batch)]


def decode_step_s(llm: LLM, batch: int, context: int, steps: int, device: torch.device) -> float:
    """Seconds per decode step for `batch` requests at `context` tokens, through generate."""
    ps = prompts(batch, context, llm.config.vocab_size, seed=batch * 7919 + context)

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return timed(lambda: llm.generate(ps, params), device)

    run(2), run(2 + steps)  # warm: allocator, pages, and kernels for every token count the steps meet
    short, long = run(2), run(2 + steps)
    return (long - short) / steps


def prefill_tok_s(llm: LLM, length: int, device: torch.device) -> float:
    prompt = prompts(1, length, llm.config.vocab_size, seed=length)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params)  # warm this length's kernels (autotune keys include the length)
    return length / timed(lambda: llm.generate(prompt, params), device)


def distinct_experts(llm: LLM, batch: int, context: int) -> float:
    """Mean distinct routed experts per MoE layer in one decode step of `batch` requests (untimed, eager)."""
    seen: list[int] = []

    class Recorder:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __call__(self, layer, x, expert_ids, weights, shared_expert=None):
            if x.shape[0] == batch:  # a step of the decode batch (prefill chunks have other sizes)
                seen.append(int(expert_ids.unique().numel()))
            return self.inner(layer, x, expert_ids, weights, shared_expert)

    moes = [layer.mlp for layer in llm.model.layers if isinstance(layer.mlp, MoE)]
    graphs, llm.runner.graphs = llm.runner.graphs, None
    for moe in moes:
        moe.experts = Recorder(moe.experts)
    try:
        ps = prompts(batch, context, llm.config.vocab_size, seed=batch * 7919 + context)
        # Chunked prefill lets early requests decode while later ones prefill: run until all decode together.
        prefill_steps = -(-batch * context // llm.scheduler.limits.max_num_batched_tokens)
        llm.generate(ps, SamplingParams(max_tokens=prefill_steps + 2, temperature=0.0, ignore_eos=True))
    finally:
        for moe in moes:
            moe.experts = moe.experts.inner
        llm.runner.graphs = graphs
    decode_counts = seen[-len(moes):]  # the last pass over the layers is a decode step of the whole batch
    return sum(decode_counts) / len(decode_counts)


def weight_bytes(cfg: ModelConfig, weights: dict) -> tuple[int, float]:
    """(bytes of every non-expert weight but the embedding, bytes of one routed expert)."""
    dense = sum(nbytes(w) for name, w in weights.items() if ".experts." not in name and not name.startswith("embed"))
    layer = cfg.moe_layers[0]
    per_expert = sum(nbytes(weights[f"layers.{layer}.mlp.experts.{p}"]) for p in EXPERT_PROJS) / cfg.n_routed_experts
    return dense, per_expert


def step_bytes(cfg: ModelConfig, sizes: tuple[int, float], batch: int, context: int, experts_per_layer: float) -> float:
    """The fewest bytes one decode step must read: every non-expert weight once (the embedding row
    aside), `experts_per_layer` distinct routed experts per MoE layer, and per request its KDA states
    (fp32, read and written), the DSA latents attention can select and the pooled keys it scores."""
    dense, per_expert = sizes
    kda = 2 * cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4
    selectable = cfg.index_select_pools * cfg.index_kpool + cfg.index_kpool - 1
    dsa = min(context + 1, selectable) * cfg.kv_lora_rank * 2 + context // cfg.index_kpool * cfg.index_head_dim * 2
    per_request = len(cfg.kda_layers) * kda + len(cfg.dsa_layers) * dsa
    return dense + len(cfg.moe_layers) * experts_per_layer * per_expert + batch * per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--format", default="nvfp4-ct", choices=["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
    parser.add_argument("--contexts", default="1024,16384", help="batch-1 decode contexts")
    parser.add_argument("--batches", default="4,8,16", help="decode batch sizes at the first context")
    parser.add_argument("--prefills", default="512,2048,8192")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per figure")
    parser.add_argument("--reference-layers", type=int, default=4, help="0 skips the transformers reference")
    parser.add_argument("--tiny", action="store_true", help="the tiny model's shapes (CPU smoke run)")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one batch-1 decode step")
    parser.add_argument("--profile-prefill", type=int, help="print the top ops of a prefill of this many tokens")
    parser.add_argument("--max-prefill-tokens", type=prefill_tokens_arg, help="prefills in steps of this many "
                        "tokens (a lone prompt's budget, decode steps keep 2,048), or 'auto' (with --expert-slots "
                        "auto): as the memory plan chooses them from the link's and the matmul's measured rates; "
                        "default: each prefill in one step")
    parser.add_argument("--expert-slots", help="hybrid offload: routed experts per MoE layer kept in device memory "
                        "('auto': as many as fit), the rest in pinned host RAM (default: every expert on the device)")
    parser.add_argument("--max-expert-swaps", type=int, default=4, help="hybrid: experts moved into device slots "
                        "per step, at most")
    parser.add_argument("--pcie-percent", type=int, help="hybrid: share of decode misses run on the GPU after a "
                        "PCIe copy (default: from the rates measured at load)")
    parser.add_argument("--cpu-threads", type=int, help="hybrid: threads of the CPU expert executor (default: "
                                                         "every usable core but one with a GPU)")
    parser.add_argument("--no-cpu-pin", action="store_true", help="hybrid: leave the CPU expert threads unpinned")
    parser.add_argument("--routing-skew", type=float, default=0.0, help="hybrid: skew the routing toward a few "
                        "experts per layer (Zipf-like: selection bias -S*log(rank)); 0 keeps the synthetic router's "
                        "near-uniform routing")
    parser.add_argument("--expert-variety", type=int, help="distinct expert values per layer (a faster build at "
                        "release size: each expert still has its own memory)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    if args.max_prefill_tokens == AUTO and args.expert_slots != AUTO:
        parser.error("--max-prefill-tokens auto is the memory plan's choice: it needs --expert-slots auto")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's event= lines (placement, split)

    device, dtype = torch.device(args.device), torch.bfloat16
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",") if b]
    prefills = [int(p) for p in args.prefills.split(",") if p]
    if args.tiny:
        contexts, prefills, batches = [min(c, 64) for c in contexts], [min(p, 96) for p in prefills], batches[:1]
    cfg = bench_config(args.format, args.layers, args.tiny)
    result: dict[str, Any] = {}

    def report(values: dict[str, Any]) -> None:
        """Print as soon as measured, so a later failure keeps the earlier figures."""
        result.update(values)
        for key, value in values.items():
            print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}", flush=True)

    start = time.perf_counter()
    hybrid = args.expert_slots is not None
    max_len = max(contexts + prefills) + args.steps + (SETTLE_MAX_STEPS if hybrid else 0) + 8
    # Each prefill in one step, or with --max-prefill-tokens in steps of that many (a lone prompt's budget; steps
    # with decodes keep 2,048): the serving path's chunks of a long prompt.
    max_batched = 2048 if args.max_prefill_tokens else max(prefills + [2048])
    slots, prefill_tokens = None, None if args.max_prefill_tokens == AUTO else args.max_prefill_tokens
    if hybrid:
        memory = EngineOptions(max_num_seqs=max(batches + [1]), max_model_len=max_len,
                               max_num_batched_tokens=max_batched, max_prefill_tokens=prefill_tokens,
                               prefix_cache=False)  # as the LLM below
        if args.expert_slots == "auto":
            measure = (lambda: measured_prefill_rates(device)) if args.max_prefill_tokens == AUTO else None
            plan = auto_plan(cfg, args.format, device, memory, measure)
            slots, prefill_tokens = plan.expert_slots, plan.prefill_tokens
        else:
            slots = int(args.expert_slots)
        report({"expert_slots_per_layer": slots, "host_read_GBps": read_bandwidth(torch.ones((4 << 30) // 4))})
        if prefill_tokens is not None:
            report({"prefill_chunk_tokens": prefill_tokens})
    weights = synthetic_weights(cfg, args.format, device, dtype, expert_slots=slots, expert_variety=args.expert_variety)
    if args.routing_skew:
        skew_routing(cfg, weights, args.routing_skew)
    sync(device)
    sizes = weight_bytes(cfg, weights)
    head_bytes = nbytes(weights["lm_head"]) + nbytes(weights["norm.weight"])
    report({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "layers": cfg.num_layers, "format": args.format,
            "build_s": time.perf_counter() - start})
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 256 << 20) * 1e9
    report({"copy_bandwidth_gbs": bandwidth / 1e9})
    start = time.perf_counter()
    budget = slots * round(sizes[1]) * len(cfg.moe_layers) if hybrid else None
    llm = LLM.from_weights(cfg, weights, max_num_seqs=max(batches + [1]), max_model_len=max_len,
                           max_num_batched_tokens=max_batched, max_prefill_tokens=prefill_tokens,
                           moe_vram_budget=budget,
                           max_expert_swaps=args.max_expert_swaps, prefix_cache=False,  # repeated prompts
                           pcie_expert_percent=args.pcie_percent, cpu_expert_threads=args.cpu_threads,
                           cpu_expert_pin=not args.no_cpu_pin)
    if hybrid:
        report({"pcie_percent": llm.core.offload.pcie_percent})
    report({"engine_init_s": time.perf_counter() - start,
            "graph_capture_s": llm.runner.graphs.capture_s if llm.runner.graphs else 0.0})

    def decode_figures(name: str, batch: int, context: int) -> None:
        if hybrid:
            report(hybrid_decode_figures(name, llm, batch, context, args.steps, result["host_read_GBps"], sizes[1]))
            return
        step = decode_step_s(llm, batch, context, args.steps, device)
        experts = distinct_experts(llm, batch, context)
        moved = step_bytes(cfg, sizes, batch, context, experts)
        roof = moved / bandwidth
        report({f"{name}_step_ms": step * 1e3, f"{name}_tok_s": batch / step,
                f"{name}_ms_per_layer": step * 1e3 / cfg.num_layers, f"{name}_distinct_experts": experts,
                f"{name}_bytes_per_layer": moved / cfg.num_layers, f"{name}_roofline_ms": roof * 1e3,
                f"{name}_ratio_to_roofline": step / roof})

    for context in contexts:
        decode_figures(f"b1_ctx{context}", 1, context)
    for batch in batches:
        decode_figures(f"b{batch}_ctx{contexts[0]}", batch, contexts[0])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    for length in prefills:
        if device.type == "cuda":  # the step's transient tensors, against the engine's reserve for them
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        report({f"prefill{length}_tok_s": prefill_tok_s(llm, length, device)})
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device))
            report({f"prefill{length}_transient_GiB": (torch.cuda.max_memory_allocated(device) - before) / 2 ** 30,
                    "engine_reserve_GiB": reserve_bytes(max_batched, max_len) / 2 ** 30})

    if device.type == "cuda":  # what the placement left unused: room an automatic budget could give to slots
        free, _ = torch.cuda.mem_get_info(device)
        report({"device_peak_allocated_GiB": peak / 2 ** 30,
                "device_reserved_GiB": torch.cuda.memory_reserved(device) / 2 ** 30, "device_free_GiB": free / 2 ** 30})
    # Per layer: the step less the head at its roofline (the head runs once per step, whatever the depth).
    head_ms = head_bytes / bandwidth * 1e3
    b1 = (result[f"b1_ctx{contexts[0]}_step_ms"] - head_ms) / cfg.num_layers
    if cfg.num_layers != FULL_LAYERS:
        report({"extrapolated_45_layers_ms_per_token (est.)": b1 * FULL_LAYERS + head_ms,
                "extrapolated_45_layers_tok_s (est.)": 1e3 / (b1 * FULL_LAYERS + head_ms)})
    if args.profile:
        profile_step(llm, device)
    if args.profile_prefill:
        profile_prefill(llm, device, args.profile_prefill)
    del llm

    if args.reference_layers and not args.tiny and not hybrid:  # hybrid moved the experts into the engine
        keep = {k: v for k, v in weights.items() if not k.startswith("layers.")
                or int(k.split(".")[1]) < args.reference_layers}
        del weights
        ref_text = slice_text_config(args.reference_layers)
        model, lm_head = reference_model(ref_text, keep, dtype, device)
        prompt = prompts(1, contexts[0], cfg.vocab_size, seed=1)[0]
        ref = time_reference(model, lm_head, prompt, 12, device)
        ref_layer_ms = ref["decode_ms"] / args.reference_layers
        report({"reference_layers": args.reference_layers, "reference_decode_ms_per_layer": ref_layer_ms,
                "reference_prefill_tok_s": contexts[0] / ref["prefill_s"],
                "speedup_decode_per_layer": ref_layer_ms / b1})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def hybrid_decode_figures(name: str, llm: LLM, batch: int, context: int, steps: int, host_read: float,
                          per_expert: float) -> dict[str, float]:
    """Hybrid offload decode, timed step by step through the engine loop once every request decodes (the
    prefill and its expert fetches excluded), then through `LLM.generate` as the resident figures are
    (`decode_step_s`: two lengths, the prefill cancels): wall ms per step, the share of routed pairs whose
    expert was in a device slot, the CPU executor's read rate on the misses, the bytes the PCIe share moved,
    and the host side's roofline (the missed experts' bytes over the host read rate measured in this run)."""
    core = llm.core
    params = SamplingParams(max_tokens=steps + SETTLE_MAX_STEPS + 8, temperature=0.0, ignore_eos=True)
    seqs = [llm._sequence(p, params) for p in prompts(batch, context, llm.config.vocab_size, seed=batch + context)]
    for seq in seqs:
        core.add(seq)
    while any(not seq.output_token_ids for seq in seqs):
        core.step()
    warm = settle_swaps(core)
    before = dataclasses.replace(core.offload.stats)
    sync(llm.model.device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(llm.model.device)
    seconds = (time.perf_counter() - start) / steps
    after = core.offload.stats
    for seq in seqs:
        core.abort(seq.request_id)
    d = {k: getattr(after, k) - getattr(before, k)
         for k in ("device_pairs", "host_pairs", "fetched_pairs", "fetched_bytes", "host_seconds", "host_bytes",
                   "swaps")}
    pairs = d["device_pairs"] + d["host_pairs"] + d["fetched_pairs"]
    host_ms = (d["host_bytes"] + d["fetched_bytes"]) / steps / (host_read * 1e9) * 1e3  # every miss read from RAM
    generate_s = decode_step_s(llm, batch, context, steps, llm.model.device)  # the same, through the public path
    return {f"{name}_warm_steps": warm, f"{name}_step_ms": seconds * 1e3, f"{name}_tok_s": batch / seconds,
            f"{name}_generate_step_ms": generate_s * 1e3, f"{name}_generate_tok_s": batch / generate_s,
            f"{name}_hit_rate": d["device_pairs"] / max(pairs, 1),
            f"{name}_ideal_hit_rate": ideal_hit_rate(core.offload.counts.cpu(), len(core.offload.resident[
                core.offload.layers[0]])),
            f"{name}_host_pairs_per_step": d["host_pairs"] / steps,
            f"{name}_pcie_pairs_per_step": d["fetched_pairs"] / steps,
            f"{name}_distinct_host_experts_per_step": d["host_bytes"] / steps / per_expert,
            f"{name}_swaps_per_step": d["swaps"] / steps,
            f"{name}_pcie_percent": core.offload.pcie_percent,  # where the split stood after the timed steps
            f"{name}_cpu_GBps": d["host_bytes"] / d["host_seconds"] / 1e9 if d["host_seconds"] > 0 else 0.0,
            f"{name}_cpu_ms_per_step": d["host_seconds"] / steps * 1e3,
            # The link's share: what crossed it per step, over the step's wall time (it runs on the device,
            # beside the rest, so its own rate while busy is higher; the profile's gather times show that).
            f"{name}_pcie_GB_per_step": d["fetched_bytes"] / steps / 1e9,
            f"{name}_pcie_GBps_over_step": d["fetched_bytes"] / steps / seconds / 1e9,
            f"{name}_host_roofline_ms": host_ms, f"{name}_ratio_to_host_roofline": seconds * 1e3 / max(host_ms, 1e-9)}


def settle_swaps(core: Any) -> int:
    """Decode until the placement has followed the routing (at most SETTLE_WINDOW // 4 swaps in the last
    SETTLE_WINDOW steps, or SETTLE_MAX_STEPS in all): the figures are the steady state a serving engine
    reaches after a few seconds, not the first steps after a load placed the experts by id. Returns the steps."""
    history: list[int] = []
    while len(history) < SETTLE_MAX_STEPS:
        before = core.offload.stats.swaps
        core.step()
        history.append(core.offload.stats.swaps - before)
        if len(history) >= SETTLE_WINDOW and sum(history[-SETTLE_WINDOW:]) <= SETTLE_WINDOW // 4:
            break
    return len(history)


def skew_routing(cfg: ModelConfig, weights: dict, skew: float, seed: int = 7) -> None:
    """A Zipf-like routing trace: each MoE layer's selection bias favours experts by a random rank order,
    -skew * log(1 + rank), so a few experts take most pairs (as trained routers do) in a different order
    per layer (the loader placed experts by id, so the hot ones start mostly on the host)."""
    gen = torch.Generator().manual_seed(seed)
    for layer in cfg.moe_layers:
        bias = weights[f"layers.{layer}.mlp.gate.e_score_correction_bias"]
        rank = torch.randperm(cfg.n_routed_experts, generator=gen).float()
        bias.copy_(-skew * torch.log1p(rank))


def ideal_hit_rate(counts: torch.Tensor, slots: int) -> float:
    """The hit rate if each layer's `slots` most-routed experts (by the engine's decayed counts) sat in its
    slots: what a perfect placement would reach on this routing."""
    top = counts.float().sort(dim=1, descending=True).values[:, :slots].sum(1)
    return float((top / counts.float().sum(1).clamp(min=1e-9)).mean())


def auto_plan(cfg: ModelConfig, fmt: str, device: torch.device, options: EngineOptions,
              measure_rates: Callable[[], PrefillRates | None] | None = None) -> MemoryPlan:
    """The engine's memory plan of the whole model under an automatic budget (its expert slots a layer, and with
    `measure_rates` its prefill chunk), over the weights' bytes (bf16 an upper bound for the others), with 2 GiB
    of the free memory kept for the largest tensor the synthetic build allocates beside the weights. With drafts,
    the MTP layer: its experts placed like the others' where stored alike, else (the NVFP4 releases' FP8 blocks)
    whole on the device."""
    mtp = list(mtp_specs(cfg)) if options.drafts_on else []
    mtp_placed = bool(mtp) and not unplaced_expert_layers(cfg, fmt)
    dense = sum(math.prod(spec.shape) * 2 for spec in text_specs(cfg) if not EXPERT_KEY.match(spec.name))
    dense += sum(math.prod(spec.shape) * (1 if quantized_in_release(cfg, spec) else 2) for spec in mtp
                 if not (mtp_placed and EXPERT_KEY.match(spec.name)))
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    per_matrix = {"nvfp4-ct": inter * hidden * 9 // 16, "nvfp4-modelopt": inter * hidden * 9 // 16,
                  "fp8": inter * hidden, "bf16": 2 * inter * hidden}[fmt]
    layers = len(cfg.moe_layers) + mtp_placed
    experts = 3 * per_matrix * layers * cfg.n_routed_experts
    free = torch.cuda.mem_get_info(device)[0] - (2 << 30)
    return plan_memory(cfg, dataclasses.replace(options, moe_vram_budget=AUTO), device, torch.bfloat16,
                       WeightBytes(dense + experts, experts, layers), free, measure_rates)


def prefill_tokens_arg(value: str) -> int | str:
    """--max-prefill-tokens: a count of tokens, or 'auto'."""
    return AUTO if value == AUTO else int(value)


# Ops that move data without math: where they are called from says which copy a kernel could fold in.
DATA_MOVES = frozenset(("aten::copy_", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::clone",
                        "aten::reshape", "aten::index", "aten::index_put_", "aten::cat", "aten::gather",
                        "aten::scatter_", "aten::fill_", "aten::zero_"))
PROJECT_FRAME = re.compile(r"(?<![\w.])(?:engine|worker)/[\w/]+\.py\(\d+\): \S+")  # a profiler's Python frame of ours


def profiled(device: torch.device, run: Callable[[], Any], stacks: bool = False):
    """`run()` under torch's profiler (the device's kernels too, where there is a GPU), waited for -> the profile;
    `stacks`: each op's Python call site recorded too."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=stacks) as prof:
        run()
        sync(device)
    return prof


def profile_step(llm: LLM, device: torch.device, steps: int = 8) -> None:
    """Top ops of `steps` batch-1 decode steps (the prompt's prefill runs before the profile), replayed from
    the CUDA graphs (each kernel by name: what the served step spends) and eager (each op by name), and the
    device's kernel time per step: next to the graphed step's wall time, what launches and gaps cost."""
    core = llm.core
    params = SamplingParams(max_tokens=4 * steps + 8, temperature=0.0, ignore_eos=True)
    seq = llm._sequence(prompts(1, 16, llm.config.vocab_size, seed=3)[0], params)
    core.add(seq)
    while not seq.output_token_ids:
        core.step()
    graphs = llm.runner.graphs
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"

    def run_steps() -> None:
        for _ in range(steps):
            core.step()
    try:
        for mode in ("graphed", "eager") if graphs else ("eager",):
            llm.runner.graphs = graphs if mode == "graphed" else None  # eager, so the profile names each op
            run_steps()  # warm this mode's shapes
            sync(device)
            prof = profiled(device, run_steps)
            print(f"profile: {steps} {mode} batch-1 decode steps, {llm.config.num_layers} layers", flush=True)
            print(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90), flush=True)
            if device.type == "cuda":
                kernels, seconds = device_kernels(prof)
                print(f"profile_{mode}_kernels_per_step={kernels / steps:.0f}", flush=True)
                print(f"profile_{mode}_kernel_ms_per_step={seconds / steps * 1e3:.3f}", flush=True)
    finally:
        llm.runner.graphs = graphs
        core.abort(seq.request_id)


def profile_prefill(llm: LLM, device: torch.device, length: int) -> None:
    """Top ops of one prefill of `length` tokens (after an untimed one of the same length), by device time and by
    host time (a host wait on the device shows as a long host op: where a step stops queueing work), and the
    device's kernel time against the wall time: what the link's copies, syncs and gaps leave idle."""
    prompt = prompts(1, length, llm.config.vocab_size, seed=length + 1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params)
    sync(device)
    start = time.perf_counter()
    prof = profiled(device, lambda: llm.generate(prompt, params), stacks=True)
    wall = time.perf_counter() - start
    table = prof.key_averages()
    for sort in (["cuda_time_total"] if device.type == "cuda" else []) + ["cpu_time_total"]:
        print(f"profile: prefill of {length} tokens, {llm.config.num_layers} layers, by {sort}", flush=True)
        print(table.table(sort_by=sort, row_limit=40, max_name_column_width=90), flush=True)
    print(f"profile: prefill of {length} tokens, data movement by call site", flush=True)
    for line in data_moves_by_site(prof, device):
        print(line, flush=True)
    print(f"profile_prefill{length}_wall_ms={wall * 1e3:.1f}", flush=True)
    if device.type == "cuda":
        kernels, seconds = device_kernels(prof)
        print(f"profile_prefill{length}_kernels={kernels} profile_prefill{length}_kernel_ms={seconds * 1e3:.1f}",
              flush=True)


def data_moves_by_site(prof, device: torch.device, rows: int = 25) -> list[str]:
    """The DATA_MOVES ops of a profile recorded with stacks (the outermost of nested ones, e.g. a `contiguous`
    and not the copy inside it), by the innermost project function that called them (named by its file and
    first line), the costliest first (device time on CUDA, else host time): `ms calls op site`."""
    timed_on = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    sites: dict[tuple[str, str], list[float]] = {}
    for event in prof.events():
        if event.name not in DATA_MOVES:
            continue
        # Python frames come as the op's stack (innermost first) or as parent events, by torch version.
        site = next((frame.group(0) for line in event.stack or () if (frame := PROJECT_FRAME.search(line))),
                    "(outside the engine)")
        parent = event.cpu_parent
        while parent is not None and parent.name not in DATA_MOVES:
            frame = PROJECT_FRAME.search(parent.name)
            if frame:
                site = frame.group(0)
                break
            parent = parent.cpu_parent
        if parent is not None and parent.name in DATA_MOVES:
            continue  # inside an outer move, counted there
        totals = sites.setdefault((event.name, site), [0.0, 0])
        totals[0] += getattr(event, timed_on) / 1e3
        totals[1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:rows]
    return [f"{ms:9.1f} ms {calls:6d}x {op:18s} {site}" for (op, site), (ms, calls) in ranked]


if __name__ == "__main__":
    main()
