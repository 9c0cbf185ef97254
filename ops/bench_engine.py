"""Engine baseline on one GPU: a full-width slice of GLM-5.3-Flash with synthetic weights in a release format.

Builds the slice directly on the device (default: 3 KDA + 1 DSA layers, all MoE with 288 NVFP4
compressed-tensors experts, real vocab), then measures in one run:
  - our batch-1 decode (ms per token and per layer) and prefill tokens/s at 2048 tokens;
  - the transformers reference (`Glm5NextTextModel` + lm_head) on the same weights, same prompt;
  - bf16 logit agreement between the two on a prompt long enough for sparse selection;
  - the HBM roofline: bytes one decode token reads (weights + per-request state) over measured copy bandwidth.

    python ops/bench_engine.py --device cuda            # the figure recorded in ops/BENCHMARKS.md
    python ops/bench_engine.py --tiny --device cpu      # smoke run of the same code on the tiny model
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from engine import LLM
from engine.checkpoint.layout import EXPERT_PROJS, stacked_expert_name
from engine.config import ModelConfig
from engine.sequence import Sequence
from engine.sampling_params import SamplingParams
from engine.tiny.factory import synthetic_weights, tiny_config
from engine.weights import Weight

RELEASED_TEXT = {  # GLM-5.3-Flash text config (zai-org/GLM-5.3-Flash), layer count set per run
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256, "n_routed_experts": 288,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "n_group": 1, "topk_group": 1, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "index_kpool": 4, "index_kpool_always_select_tail": True, "linear_num_heads": 64, "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
    "rms_norm_eps": 1e-5, "swiglu_limit": 10.0, "max_position_embeddings": 1048576,
}


def slice_text_config(num_layers: int) -> dict[str, Any]:
    """Layers keep the release's i % 4 == 3 DSA pattern; every layer is MoE (the costly kind)."""
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    return {**RELEASED_TEXT, "num_hidden_layers": num_layers, "layer_types": kinds,
            "mlp_layer_types": ["sparse"] * num_layers, "quantization_config": None}


FULL_LAYERS = 45


def bench_text_config(fmt: str, layers: int, tiny: bool = False, mtp: bool = False) -> dict[str, Any]:
    """The text config a benchmark builds: the tiny model's shapes or a release-shape slice of `layers` (all 45:
    the release's three dense MLP layers first); `mtp` adds the checkpoint's MTP layer."""
    text = dict(tiny_config(fmt)["text_config"]) if tiny else slice_text_config(layers)
    if not tiny and layers == FULL_LAYERS:
        text["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * (FULL_LAYERS - 3)
    if mtp:
        text["num_nextn_predict_layers"] = 1
    return text


def bench_config(fmt: str, layers: int, tiny: bool = False, mtp: bool = False) -> ModelConfig:
    """That text config with `fmt`'s quantization config, without which the experts would be built in bf16."""
    return ModelConfig.from_dict({"text_config": bench_text_config(fmt, layers, tiny, mtp),
                                  "quantization_config": tiny_config(fmt).get("quantization_config")})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_kernels(prof) -> tuple[int, float]:
    """(kernels, their device seconds) a torch.profiler run recorded: what the device was busy with."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.device_time for e in kernels) / 1e6


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Measured device copy rate in GB/s (bytes read + written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - start) / 1e9


def decode_bytes(cfg: ModelConfig, weights: dict, context: int) -> dict[str, float]:
    """Bytes one batch-1 decode token must read, per layer and for the head (embedding row excluded)."""
    per_layer = []
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        dense = sum(nbytes(w) for name, w in weights.items() if name.startswith(prefix) and ".experts." not in name)
        stacks = [weights[stacked_expert_name(i, p)] for p in EXPERT_PROJS] if cfg.mlp_kinds[i] == "moe" else []
        experts = cfg.num_experts_per_tok * sum(nbytes(s) for s in stacks) / max(cfg.n_routed_experts, 1)
        if cfg.layer_kinds[i] == "kda":  # fp32 recurrent state read and written, conv state
            state = 2 * cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4
        else:  # latents and pooled indexer keys of the context
            state = context * cfg.kv_lora_rank * 2 + context // cfg.index_kpool * cfg.index_head_dim * 2
        per_layer.append(dense + experts + state)
    head = nbytes(weights["lm_head"]) + nbytes(weights["norm.weight"])
    return {"per_layer": sum(per_layer) / len(per_layer), "total": sum(per_layer) + head, "head": head}


def nbytes(w: Weight | torch.Tensor) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def time_engine(llm: LLM, prompt: list[int], decode_steps: int, device: torch.device,
                profile: bool = False) -> dict[str, float]:
    llm.prompt_logits(prompt[:128])  # warm-up: library handles, allocator, kernels
    seq = Sequence(0, prompt, SamplingParams(max_tokens=decode_steps + 2))
    llm.scheduler.add(seq)
    step = llm.scheduler.schedule()
    sync(device)
    start = time.perf_counter()
    logits = llm.core.teacher_forced_step(step)
    sync(device)
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(decode_steps):
        seq.output_token_ids.append(int(logits[-1].argmax()))
        start = time.perf_counter()
        logits = llm.core.teacher_forced_step([(seq, 1)])
        sync(device)
        times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            seq.output_token_ids.append(int(logits[-1].argmax()))
            llm.core.teacher_forced_step([(seq, 1)])
            sync(device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    llm.scheduler.finish(seq)
    times = sorted(times[2:])  # the first steps warm allocator and kernels
    return {"prefill_s": prefill_s, "decode_ms": 1e3 * times[len(times) // 2]}


def reference_model(cfg_dict: dict[str, Any], weights: dict, dtype: torch.dtype, device: torch.device):
    """transformers' Glm5NextTextModel + lm_head holding the same (dequantized) weights."""
    from transformers.models.glm5_next import configuration_glm5_next as conf
    from transformers.models.glm5_next import modeling_glm5_next as modeling

    if not hasattr(modeling, "Glm5NextTextIndexer"):
        raise RuntimeError("this transformers has no Glm5NextTextIndexer (it would run dense MLA)")
    text = {"pad_token_id": None, **{k: v for k, v in cfg_dict.items() if k != "quantization_config"}}
    config = conf.Glm5NextTextConfig(**text)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = modeling.Glm5NextTextModel(config)
    model.load_state_dict(hf_state_dict(ModelConfig.from_dict(text), weights, dtype), assign=True, strict=True)
    lm_head = weights["lm_head"].dequantize(dtype)
    return model.eval().to(device), lm_head


def hf_state_dict(cfg: ModelConfig, weights: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    renames = {"hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
               "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
               "self_attn.f_a_proj": "self_attn.forget_gate.f_a_proj", "self_attn.f_b_proj": "self_attn.forget_gate.f_b_proj",
               "self_attn.dt_bias": "self_attn.forget_gate.dt_bias", "self_attn.A_log": "self_attn.forget_gate.A_log"}
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if ".experts." in name or "_conv1d" in name or name == "lm_head":
            continue
        key = name
        for old, new in renames.items():
            key = key.replace(old, new)
        if isinstance(w, torch.Tensor):
            out[key] = w
        else:
            out[key + ".weight"] = w.dequantize(dtype)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if cfg.layer_kinds[i] == "kda":
            out[p + "self_attn.conv1d.weight"] = torch.cat([weights[f"{p}self_attn.{x}_conv1d.weight"] for x in "qkv"])
        if cfg.mlp_kinds[i] == "moe":
            gate, up, down = (weights[stacked_expert_name(i, proj)] for proj in EXPERT_PROJS)
            out[p + "mlp.experts.gate_up_proj"] = torch.cat([_dequant_chunks(gate, dtype), _dequant_chunks(up, dtype)], 1)
            out[p + "mlp.experts.down_proj"] = _dequant_chunks(down, dtype)
    return out


def _dequant_chunks(stack: Weight, dtype: torch.dtype, chunk: int = 32) -> torch.Tensor:
    """Expand an expert stack in slices, so the transient fp32 copy stays small."""
    return torch.cat([stack[e: e + chunk].dequantize(dtype) for e in range(0, stack.shape[0], chunk)])


@torch.inference_mode()
def time_reference(model, lm_head: torch.Tensor, prompt: list[int], decode_steps: int,
                   device: torch.device) -> dict[str, float]:
    from transformers import DynamicCache

    model(input_ids=torch.tensor([prompt[:128]], device=device))  # warm-up, as for the engine
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], device=device)
    sync(device)
    start = time.perf_counter()
    hidden = model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state
    logits = hidden[0, -1] @ lm_head.t()
    sync(device)
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(decode_steps):
        token = logits.argmax().view(1, 1)
        start = time.perf_counter()
        hidden = model(input_ids=token, cache=cache, use_cache=True).last_hidden_state
        logits = hidden[0, -1] @ lm_head.t()
        sync(device)
        times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    return {"prefill_s": prefill_s, "decode_ms": 1e3 * times[len(times) // 2]}


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    rel = float((ours - ref).abs().max() / ref.abs().max())
    cos = float(torch.nn.functional.cosine_similarity(ours.flatten().double(), ref.flatten().double(), dim=0))
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_max_diff": rel, "cosine": cos, "top1_agreement": top1}


@torch.inference_mode()
def reference_logits(model, lm_head: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    hidden = model(input_ids=torch.tensor([prompt], device=lm_head.device)).last_hidden_state[0]
    return (hidden @ lm_head.t()).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--format", default="nvfp4-ct", choices=["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--parity-prompt", type=int, default=2304, help="> 2051 so the indexer drops positions")
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="the tiny model's shapes (CPU smoke run)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a profile of one engine decode step")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.tiny:
        args.prefill, args.parity_prompt = min(args.prefill, 64), min(args.parity_prompt, 80)
    cfg = bench_config(args.format, args.layers, args.tiny)
    start = time.perf_counter()
    weights = synthetic_weights(cfg, args.format, device, dtype)
    sync(device)
    result: dict[str, Any] = {}

    def report(values: dict[str, Any]) -> None:
        """Print as soon as measured, so a later failure keeps the earlier figures."""
        result.update(values)
        for key, value in values.items():
            print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}", flush=True)

    report({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "layers": cfg.num_layers, "format": args.format,
            "build_s": time.perf_counter() - start})
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 256 << 20)
    llm = LLM.from_weights(cfg, weights, max_num_seqs=1, max_model_len=max(args.prefill, args.parity_prompt) + 64,
                           prefix_cache=False)  # time_engine runs the whole prompt as one prefill step
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(cfg.vocab_size, 150000), (args.parity_prompt,), generator=gen).tolist()
    ours = time_engine(llm, prompt[: args.prefill], args.decode_steps, device, args.profile)
    moved = decode_bytes(cfg, weights, args.prefill)
    roofline_ms = moved["total"] / (bandwidth * 1e9) * 1e3
    report({
        "copy_bandwidth_gbs": bandwidth,
        "decode_ms_per_token": ours["decode_ms"], "decode_ms_per_layer": ours["decode_ms"] / cfg.num_layers,
        "prefill_tokens": args.prefill, "prefill_tok_s": args.prefill / ours["prefill_s"],
        "decode_bytes_per_token": moved["total"], "decode_bytes_per_layer": moved["per_layer"],
        "roofline_ms_per_token": roofline_ms, "roofline_ms_per_layer": moved["per_layer"] / (bandwidth * 1e9) * 1e3,
        "ratio_to_roofline": ours["decode_ms"] / roofline_ms,
    })
    if device.type == "cuda":
        report({"engine_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30})
    ours_logits = llm.prompt_logits(prompt)
    if dtype != torch.float32:
        # fp32 truth: the same weights upcast (the engine's fp32 path matches transformers to 1e-5 in CI).
        truth_llm = LLM.from_weights(cfg, synthetic_weights(cfg, args.format, device, torch.float32), max_num_seqs=1,
                                     max_model_len=args.parity_prompt + 64, prefix_cache=False)
        truth = truth_llm.prompt_logits(prompt)
        del truth_llm
        report({f"engine_vs_fp32_{k}": v for k, v in agreement(ours_logits, truth).items()})
    if not args.skip_reference:
        model, lm_head = reference_model(bench_text_config(args.format, args.layers, args.tiny), weights, dtype,
                                         device)
        ref = time_reference(model, lm_head, prompt[: args.prefill], args.decode_steps, device)
        report({"reference_decode_ms_per_token": ref["decode_ms"],
                       "reference_decode_ms_per_layer": ref["decode_ms"] / cfg.num_layers,
                       "reference_prefill_tok_s": args.prefill / ref["prefill_s"]})
        ref_logits = reference_logits(model, lm_head, prompt)
        report({f"engine_vs_reference_{k}": v for k, v in agreement(ours_logits, ref_logits).items()})
        if dtype != torch.float32:
            report({f"reference_vs_fp32_{k}": v for k, v in agreement(ref_logits, truth).items()})
    report({"parity_prompt_tokens": args.parity_prompt})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
