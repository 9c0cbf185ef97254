"""A complete small glm5_next snapshot in the official layout, in any of the four weight formats.

Shapes are tiny but every mechanism is live: 8 layers (6 KDA + 2 DSA, one dense MLP then MoE),
16 experts top-4, an indexer that keeps 8 pools of 4 (so prompts past 35 tokens drop positions),
and weights scaled so that routing, pool selection and mHC mixing are far from uniform.
Dimensions are deliberately not multiples of 128, so FP8 blocks are ragged.

Those weights make bf16 chaotic (a rounding flips an expert or a pool, and the flip spreads), so
bf16 tests use the `well_conditioned` variant, where bf16 stays close to fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from engine.checkpoint.loader import LoadedWeights, assemble
from engine.checkpoint.layout import (EXPERT_KEY, TensorSpec, checkpoint_key, in_mtp_layer, mtp_layer_indices,
                                      mtp_specs, quantized_in_release, stacked_expert_name, text_specs, vision_specs)
from engine.config import ModelConfig
from engine.quant import quantize_fp8_block, quantize_nvfp4
from engine.tiny.tokenizer import write_tokenizer

FORMATS = {"bf16": None, "fp8": "fp8", "nvfp4-ct": "compressed-tensors", "nvfp4-modelopt": "modelopt"}
SHARD_BYTES = 2 << 20
NUM_LAYERS = 8
DSA_LAYERS = [3, 7]
# Well-conditioned variant: every sublayer's output projection at this fraction of unit gain, so
# the residual streams dominate and a sublayer's rounding error reaches them damped ...
BRANCH_GAIN = 0.2
# ... and each routed expert a shared matrix plus this fraction of its own, so the near-ties that bf16
# flips to a neighbouring expert move the output little (routing weights still differ per token).
EXPERT_SPREAD = 0.1

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next_text",
    "vocab_size": 320,
    "hidden_size": 192,
    "intermediate_size": 320,
    "moe_intermediate_size": 96,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 0,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "mlp_layer_types": ["dense"] + ["sparse"] * (NUM_LAYERS - 1),
    "layer_types": ["full_attention" if i in DSA_LAYERS else "linear_attention" for i in range(NUM_LAYERS)],
    "linear_attn_config": {
        "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "kda_layers": [i for i in range(NUM_LAYERS) if i not in DSA_LAYERS], "full_attn_layers": DSA_LAYERS,
    },
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 32,
    "index_kpool": 4,
    "index_kpool_compress": True,
    "index_kpool_always_select_tail": True,
    "indexer_types": ["full"] * NUM_LAYERS,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "mhc": True,
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "max_position_embeddings": 1048576,
    "rope_theta": None,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


# The tiny tokenizer's image and video markers (engine/tiny/tokenizer.py), as config.json's top-level fields.
IMAGE_TOKEN_IDS = {"image_token_id": 270, "video_token_id": 271, "image_start_token_id": 266,
                   "image_end_token_id": 267, "video_start_token_id": 268, "video_end_token_id": 269}


def tiny_config(fmt: str = "bf16", **text_overrides: Any) -> dict[str, Any]:
    """config.json contents: the official nested form, with the format's quantization_config."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    config: dict[str, Any] = {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {**TEXT_CONFIG, **text_overrides},
        **IMAGE_TOKEN_IDS,
        # A small vision tower (2 blocks of width 32), written after the text model's tensors.
        "vision_config": {"model_type": "glm5_next_vision", "depth": 2, "hidden_size": 32, "num_heads": 2,
                          "intermediate_size": 64, "out_hidden_size": TEXT_CONFIG["hidden_size"],
                          "projection_intermediate_size": 64, "patch_size": 14, "image_size": 28},
    }
    if fmt != "bf16":
        config["quantization_config"] = _quantization_config(fmt)
    return config


def _quantization_config(fmt: str) -> dict[str, Any]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if fmt == "nvfp4-ct":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                   "dynamic": False, "scale_dtype": "float8_e4m3fn"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "format": "nvfp4-pack-quantized"}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.gate$"]}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate"]}


def init_value(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """A float32 random tensor for a layout entry, scaled so every mechanism is exercised."""
    name, shape = spec.name, spec.shape
    randn = torch.randn(shape, generator=generator, device=generator.device)
    if spec.role == "linear":
        return randn / math.sqrt(shape[-1])
    if name.endswith(("layernorm.weight", "norm.weight")):
        return 1.0 + 0.1 * randn
    if name.endswith("k_norm.bias"):
        return 0.1 * randn
    if "_fn" in name:  # mHC projection: strong enough that streams mix unevenly
        return 2.0 * randn / math.sqrt(shape[-1])
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=generator, device=generator.device)
    if name.endswith("gate.weight"):  # router: spread scores so top-k is decisive
        return 3.0 * randn / math.sqrt(shape[-1])
    if name.endswith("index_kpool_compress_gate"):
        return randn / math.sqrt(shape[-1])
    if name.endswith("e_score_correction_bias"):
        return 0.05 * randn
    return 0.5 * randn  # embeddings, hc base, A_log, dt_bias, convs, pool position bias


def init_values(cfg: ModelConfig, generator: torch.Generator, well_conditioned: bool = False,
                mtp: bool = True) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Every layout entry with its float32 value, in checkpoint order; the MTP layers (where the config declares
    them and `mtp`) after the vision tower, so that neither moves the values before them.

    well_conditioned: damped sublayer outputs and near-identical experts, so that a bf16 forward pass
    stays close to the fp32 one (the default weights amplify bf16 rounding into different tokens).
    """
    expert_bases: dict[str, torch.Tensor] = {}

    def value_of(spec: TensorSpec) -> torch.Tensor:
        value = init_value(spec, generator)
        if well_conditioned:
            expert = EXPERT_KEY.match(spec.name)
            if expert:
                key = stacked_expert_name(int(expert[1]), expert[3])
                if key not in expert_bases:
                    expert_bases[key] = init_value(spec, generator)
                value = expert_bases[key] + EXPERT_SPREAD * value
            if spec.name.endswith(("o_proj", "down_proj")):
                value = BRANCH_GAIN * value
        return value

    for spec in text_specs(cfg):
        yield spec, value_of(spec)
    for spec in vision_specs(cfg):  # after the text model's: its values do not move when the tower changes
        yield spec, vision_value(spec, generator)
    for spec in mtp_specs(cfg) if mtp else ():
        yield spec, value_of(spec)


def vision_value(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """A float32 random tensor for a tower entry: matrices (and convolutions) scaled by their fan-in, norm weights
    near one, biases small but not zero."""
    randn = torch.randn(spec.shape, generator=generator, device=generator.device)
    if len(spec.shape) > 1:
        return randn / math.sqrt(math.prod(spec.shape[1:]))
    if "norm" in spec.name and spec.name.endswith(".weight"):
        return 1.0 + 0.1 * randn
    return 0.1 * randn


def encode(spec: TensorSpec, value: torch.Tensor, fmt: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint entries (official keys) for one tensor stored the way the format's release stores it."""
    key = checkpoint_key(spec.name)
    if spec.role == "fp32":
        return {key: value.float().contiguous()}
    if not quantized_in_release(cfg, spec):
        return {key + (".weight" if spec.role == "linear" else ""): value.to(torch.bfloat16).contiguous()}
    if fmt == "fp8" or in_mtp_layer(cfg, spec.name):  # an NVFP4 release's MTP layer is FP8-block too
        q, scale_inv = quantize_fp8_block(value)
        return {f"{key}.weight": q, f"{key}.weight_scale_inv": scale_inv}
    packed, scale, multiplier = quantize_nvfp4(value)
    if fmt == "nvfp4-ct":
        return {f"{key}.weight_packed": packed, f"{key}.weight_scale": scale,
                f"{key}.weight_global_scale": multiplier.reciprocal()}
    return {f"{key}.weight": packed, f"{key}.weight_scale": scale, f"{key}.weight_scale_2": multiplier.reshape(()),
            f"{key}.input_scale": torch.ones(())}


def unplaced_expert_layers(cfg: ModelConfig, fmt: str) -> frozenset[int]:
    """The MoE layers a release in `fmt` stores in another format than its decoder layers' (see
    `unlike_expert_layers`): the MTP layers of the NVFP4 releases, in FP8 blocks."""
    return frozenset(mtp_layer_indices(cfg)) if fmt.startswith("nvfp4") else frozenset()


def synthetic_weights(cfg: ModelConfig, fmt: str, device: torch.device | str, dtype: torch.dtype,
                      seed: int = 0, expert_slots: int | None = None,
                      expert_variety: int | None = None) -> LoadedWeights:
    """Random weights in a release format, built directly on `device` (no files): for benchmarks at full
    width. With `expert_slots`, routed experts are split as the loader splits them (see `load_weights`).
    With `expert_variety`, each layer's experts repeat that many distinct values (each still in its own
    memory): a whole-model build in seconds per layer, for speed figures that do not depend on values. The MTP
    layers come too where the config declares them (FP8 blocks beside NVFP4 experts: kept whole on `device`, as
    the loader keeps them)."""
    generator = torch.Generator(device).manual_seed(seed)
    repeats: dict[tuple[str, str, int], dict[str, torch.Tensor]] = {}  # (layer, projection, index) -> entries

    def groups():
        for spec in [*text_specs(cfg), *mtp_specs(cfg)]:
            expert = EXPERT_KEY.match(spec.name)
            if expert and expert_variety:
                key = (expert[1], expert[3], int(expert[2]) % expert_variety)
                if key in repeats:
                    yield spec, repeats[key]
                    continue
                for old in [k for k in repeats if k[0] != expert[1]]:
                    del repeats[old]  # an earlier layer's values are no longer needed
            entries = encode(spec, init_value(spec, generator), fmt, cfg)
            entries = {_suffix(spec, key): t for key, t in entries.items() if not key.endswith("input_scale")}
            if expert and expert_variety:
                repeats[(expert[1], expert[3], int(expert[2]))] = entries
            yield spec, entries

    return assemble(cfg, groups(), device, dtype, expert_slots, unplaced_expert_layers(cfg, fmt))


def _suffix(spec: TensorSpec, key: str) -> str:
    return key[len(checkpoint_key(spec.name)) + 1:]


def write_tiny_model(out_dir: Path | str, fmt: str = "bf16", seed: int = 0, well_conditioned: bool = False,
                     **text_overrides: Any) -> Path:
    """Write config, generation config, tokenizer and sharded safetensors + index into out_dir.

    well_conditioned: weights under which bf16 tracks fp32 (see init_values); for bf16 accuracy tests.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(out)
    config = tiny_config(fmt, **text_overrides)
    if config["text_config"]["vocab_size"] < tok.vocab_size:
        raise ValueError(f"vocab_size must cover the tokenizer's {tok.vocab_size} tokens")
    config["text_config"]["eos_token_id"] = tok.eos_token_ids
    config["text_config"]["pad_token_id"] = tok.pad_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": tok.eos_token_ids, "pad_token_id": tok.pad_token_id, "do_sample": True,
                  "temperature": 1.0, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    cfg = ModelConfig.from_dict(config, generation)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    # The ModelOpt NVFP4 release has no MTP layer, though its config declares one.
    for spec, value in init_values(cfg, generator, well_conditioned, mtp=fmt != "nvfp4-modelopt"):
        entries = encode(spec, value, fmt, cfg)
        nbytes = sum(t.numel() * t.element_size() for t in entries.values())
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1].update(entries)
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
