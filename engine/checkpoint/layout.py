"""The official checkpoint layout: every tensor's name, shape and storage rule, from the config.

One table serves three users: the loader (what must be present, with which shape), the tiny
model factory (what to write) and synthetic benchmarks (what to build). Names are the official
keys without the `model.language_model.` prefix; linear weights are named without `.weight`
because their format decides the suffixes (`weight`, `weight_scale_inv`, `weight_packed`, ...). The vision
tower's tensors (BF16 in every release, `vision_specs`) are named `visual.*`, the official key less `model.`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Literal

from engine.config import ModelConfig

TensorRole = Literal["linear", "fp32", "param"]
TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
EXPERT_KEY = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint entry: `linear` may be quantized; `fp32` is kept fp32; `param` follows the compute dtype."""

    name: str
    shape: tuple[int, ...]
    role: TensorRole

    @property
    def is_expert(self) -> bool:
        return EXPERT_KEY.match(self.name) is not None


def text_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    """All tensors of the text model, in checkpoint order (layer by layer)."""
    d = cfg.hidden_size
    yield TensorSpec("embed_tokens.weight", (cfg.vocab_size, d), "param")
    for i in range(cfg.num_layers):
        yield from _layer_specs(cfg, i)
    yield TensorSpec("norm.weight", (d,), "param")
    yield TensorSpec("lm_head", (cfg.vocab_size, d), "linear")


def mtp_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    """The multi-token-prediction layers' tensors (indices num_layers..): the next token's embedding and the
    main model's hidden, each normed, projected together (`eh_proj`), then a DSA block and a MoE block as plain
    pre-norm residuals (no mHC) and the head's norm (`shared_head.norm`; the head is the model's lm_head)."""
    d = cfg.hidden_size
    for i in mtp_layer_indices(cfg):
        p = f"layers.{i}."
        yield TensorSpec(f"{p}enorm.weight", (d,), "param")
        yield TensorSpec(f"{p}hnorm.weight", (d,), "param")
        yield TensorSpec(f"{p}eh_proj", (d, 2 * d), "linear")
        yield TensorSpec(f"{p}input_layernorm.weight", (d,), "param")
        yield TensorSpec(f"{p}post_attention_layernorm.weight", (d,), "param")
        yield from _dsa_specs(cfg, p + "self_attn.")
        yield from _moe_specs(cfg, p + "mlp.")
        yield TensorSpec(f"{p}shared_head.norm.weight", (d,), "param")


def mtp_layer_indices(cfg: ModelConfig) -> range:
    return range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers)


def checkpoint_key(name: str) -> str:
    """The official key of a layout entry (a linear's, less its format's suffixes)."""
    if name == "lm_head":
        return name
    return "model." + name if name.startswith("visual.") else TEXT_PREFIX + name


def vision_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    """The vision tower's tensors (none for a text-only config), kept in the compute dtype."""
    v = cfg.vision
    if v is None:
        return
    d = v.hidden_size
    yield TensorSpec("visual.patch_embed.proj.weight", (d, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                         v.patch_size), "param")
    yield TensorSpec("visual.patch_embed.proj.bias", (d,), "param")
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        yield TensorSpec(f"{p}norm1.weight", (d,), "param")
        yield TensorSpec(f"{p}norm2.weight", (d,), "param")
        yield TensorSpec(f"{p}attn.qkv.weight", (3 * d, d), "param")
        yield TensorSpec(f"{p}attn.qkv.bias", (3 * d,), "param")
        yield TensorSpec(f"{p}attn.proj.weight", (d, d), "param")
        yield TensorSpec(f"{p}attn.proj.bias", (d,), "param")
        yield TensorSpec(f"{p}attn.q_norm.weight", (v.head_dim,), "param")
        yield TensorSpec(f"{p}attn.k_norm.weight", (v.head_dim,), "param")
        for name, shape in (("gate_proj", (v.intermediate_size, d)), ("up_proj", (v.intermediate_size, d)),
                            ("down_proj", (d, v.intermediate_size))):
            yield TensorSpec(f"{p}mlp.{name}.weight", shape, "param")
            yield TensorSpec(f"{p}mlp.{name}.bias", (shape[0],), "param")
    out, merge, inner = v.out_hidden_size, v.spatial_merge_size, v.projection_intermediate_size
    yield TensorSpec("visual.post_layernorm.weight", (d,), "param")
    yield TensorSpec("visual.downsample.weight", (out, d, merge, merge), "param")
    yield TensorSpec("visual.downsample.bias", (out,), "param")
    yield TensorSpec("visual.merger.proj.weight", (out, out), "param")
    yield TensorSpec("visual.merger.post_projection_norm.weight", (out,), "param")
    yield TensorSpec("visual.merger.post_projection_norm.bias", (out,), "param")
    yield TensorSpec("visual.merger.gate_proj.weight", (inner, out), "param")
    yield TensorSpec("visual.merger.up_proj.weight", (inner, out), "param")
    yield TensorSpec("visual.merger.down_proj.weight", (out, inner), "param")


def _layer_specs(cfg: ModelConfig, i: int) -> Iterator[TensorSpec]:
    d, s = cfg.hidden_size, cfg.hc_mult
    p = f"layers.{i}."
    for site in ("attn", "ffn"):
        yield TensorSpec(f"{p}hc_{site}_fn", ((2 + s) * s, s * d), "param")
        yield TensorSpec(f"{p}hc_{site}_base", ((2 + s) * s,), "fp32")
        yield TensorSpec(f"{p}hc_{site}_scale", (3,), "fp32")
    yield TensorSpec(f"{p}input_layernorm.weight", (d,), "param")
    yield TensorSpec(f"{p}post_attention_layernorm.weight", (d,), "param")
    yield from (_kda_specs if cfg.layer_kinds[i] == "kda" else _dsa_specs)(cfg, p + "self_attn.")
    yield from (_dense_specs if cfg.mlp_kinds[i] == "dense" else _moe_specs)(cfg, p + "mlp.")


def _kda_specs(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    d, dim, hd = cfg.hidden_size, cfg.linear_dim, cfg.linear_head_dim
    for x in "qkv":
        yield TensorSpec(f"{p}{x}_proj", (dim, d), "linear")
    for x in "qkv":
        yield TensorSpec(f"{p}{x}_conv1d.weight", (dim, 1, cfg.conv_kernel), "fp32")
    for x in "fg":
        yield TensorSpec(f"{p}{x}_a_proj", (hd, d), "linear")
        yield TensorSpec(f"{p}{x}_b_proj", (dim, hd), "linear")
    yield TensorSpec(f"{p}b_proj", (cfg.linear_num_heads, d), "linear")
    yield TensorSpec(f"{p}A_log", (cfg.linear_num_heads,), "fp32")
    yield TensorSpec(f"{p}dt_bias", (dim,), "fp32")
    yield TensorSpec(f"{p}o_norm.weight", (hd,), "param")
    yield TensorSpec(f"{p}o_proj", (d, dim), "linear")


def _dsa_specs(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    yield TensorSpec(f"{p}q_a_proj", (cfg.q_lora_rank, d), "linear")
    yield TensorSpec(f"{p}q_a_layernorm.weight", (cfg.q_lora_rank,), "param")
    yield TensorSpec(f"{p}q_b_proj", (h * cfg.qk_nope_head_dim, cfg.q_lora_rank), "linear")
    yield TensorSpec(f"{p}kv_a_proj_with_mqa", (cfg.kv_lora_rank, d), "linear")
    yield TensorSpec(f"{p}kv_a_layernorm.weight", (cfg.kv_lora_rank,), "param")
    yield TensorSpec(f"{p}kv_b_proj", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "linear")
    yield TensorSpec(f"{p}o_proj", (d, h * cfg.v_head_dim), "linear")
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    yield TensorSpec(f"{p}indexer.wq_b", (ih * ihd, cfg.q_lora_rank), "linear")
    yield TensorSpec(f"{p}indexer.wk", (ihd, d), "linear")
    yield TensorSpec(f"{p}indexer.k_norm.weight", (ihd,), "param")
    yield TensorSpec(f"{p}indexer.k_norm.bias", (ihd,), "param")
    yield TensorSpec(f"{p}indexer.weights_proj", (ih, d), "linear")
    yield TensorSpec(f"{p}indexer.index_kpool_compress_gate", (ihd, d), "param")
    yield TensorSpec(f"{p}indexer.index_kpool_compress_ape", (cfg.index_kpool, ihd), "fp32")


def _dense_specs(cfg: ModelConfig, p: str, inter: int | None = None) -> Iterator[TensorSpec]:
    d, inter = cfg.hidden_size, inter or cfg.intermediate_size
    yield TensorSpec(f"{p}gate_proj", (inter, d), "linear")
    yield TensorSpec(f"{p}up_proj", (inter, d), "linear")
    yield TensorSpec(f"{p}down_proj", (d, inter), "linear")


def _moe_specs(cfg: ModelConfig, p: str) -> Iterator[TensorSpec]:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    yield TensorSpec(f"{p}gate.weight", (cfg.n_routed_experts, d), "fp32")
    yield TensorSpec(f"{p}gate.e_score_correction_bias", (cfg.n_routed_experts,), "fp32")
    yield from _dense_specs(cfg, f"{p}shared_experts.", inter * cfg.n_shared_experts)
    for e in range(cfg.n_routed_experts):
        yield from _dense_specs(cfg, f"{p}experts.{e}.", inter)


def quantized_in_release(cfg: ModelConfig, spec: TensorSpec) -> bool:
    """Which linears each released checkpoint flavour stores quantized (the factory and benchmarks follow this).

    Official FP8: routed and shared experts, dense MLPs and the DSA projections except kv_b.
    NVFP4 (both flavours): routed experts only. Norms, routers, KDA, indexers and lm_head stay BF16.
    The MTP layer is FP8-block, as in the official release, in every flavour that has one.
    """
    method = cfg.quant.method
    if spec.role != "linear" or method == "none":
        return False
    layer = layer_of(spec.name)
    mtp = in_mtp_layer(cfg, spec.name)
    if method in ("nvfp4_ct", "nvfp4_modelopt") and not mtp:
        return spec.is_expert
    if layer is None:
        return False
    if ".mlp." in spec.name:
        return True
    dsa = mtp or cfg.layer_kinds[layer] == "dsa"
    return dsa and re.search(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)$", spec.name) is not None


_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer index of a `layers.N.*` layout name; None for the others (embeddings, head, vision tower)."""
    layer = _LAYER_NAME.match(name)
    return None if layer is None else int(layer.group(1))


def in_mtp_layer(cfg: ModelConfig, name: str) -> bool:
    """Whether a layout name is an MTP layer's (a layer index past the decoder layers)."""
    layer = layer_of(name)
    return layer is not None and layer >= cfg.num_layers


def stacked_expert_name(layer: int, proj: str) -> str:
    """Name under which the loader holds one layer's projection for all experts, stacked on dim 0."""
    return f"layers.{layer}.mlp.experts.{proj}"


STACKED_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def expert_formats(names: Iterable[str]) -> dict[int, frozenset[str]]:
    """Each MoE layer's routed-expert format as stored: the suffixes of its first expert's gate_proj tensors
    (`names`: stored tensors' layout names with their suffixes, e.g. `...gate_proj.weight_packed`)."""
    formats: dict[int, set[str]] = {}
    for name in names:
        base, _, suffix = name.rpartition(".")
        expert = EXPERT_KEY.match(base)
        if expert and expert.group(2) == "0" and expert.group(3) == EXPERT_PROJS[0]:
            formats.setdefault(int(expert.group(1)), set()).add(suffix)
    return {layer: frozenset(suffixes) for layer, suffixes in formats.items()}


def unlike_expert_layers(formats: dict[int, Hashable]) -> frozenset[int]:
    """MoE layers whose routed experts are stored in another format than the lowest MoE layer's: the MTP layer of
    the NVFP4 releases (FP8 blocks). Hybrid offload's staging and CPU kernels serve one format, so these layers'
    stacks stay whole on the device and count as device bytes in the memory plan."""
    if not formats:
        return frozenset()
    first = formats[min(formats)]
    return frozenset(layer for layer, kind in formats.items() if kind != first)


def is_expert_stack(name: str) -> bool:
    """Whether a loaded weight's name is one layer's stack of routed experts (see `stacked_expert_name`)."""
    return STACKED_EXPERT_NAME.match(name) is not None
