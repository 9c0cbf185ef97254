"""The glm5_next text configuration, parsed from every config.json form real snapshots use.

Class defaults of other implementations are never trusted (transformers' `index_kpool=16` is wrong):
every field is read from the file or from the released model's value, and inconsistent or
unsupported settings fail with the field and value named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["kda", "dsa"]
MlpKind = Literal["dense", "moe"]

DSA_LAYER_NAMES = ("deepseek_sparse_attention", "full_attention", "indexed_attention")
KDA_LAYER_NAMES = ("linear_attention", "kda")


class ConfigError(ValueError):
    """A config field holds a value the engine cannot serve; the message names both."""

    def __init__(self, field_name: str, value: Any, reason: str) -> None:
        super().__init__(f"config field {field_name!r} = {value!r}: {reason}")
        self.field_name = field_name
        self.value = value


@dataclass(frozen=True)
class QuantConfig:
    """Which quantized format the checkpoint declares (`none`, `fp8_block`, `nvfp4_ct`, `nvfp4_modelopt`)."""

    method: Literal["none", "fp8_block", "nvfp4_ct", "nvfp4_modelopt"] = "none"
    block_size: tuple[int, int] = (128, 128)
    group_size: int = 16


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the text model's width
    projection_intermediate_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    # The prompt tokens an image's embeddings replace, and the markers around a video (whose frames use the
    # same token): top-level fields of the multimodal config.
    image_token_id: int = 154854
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, text_hidden_size: int,
                  top: dict[str, Any] | None = None) -> "VisionConfig | None":
        """`config.json`'s `vision_config` (`top`: the whole config, for the image token ids), or None where
        the checkpoint has no tower."""
        if not raw:
            return None
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError("vision_config.hidden_act", raw["hidden_act"], "only silu is supported")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError("vision_config.rope_parameters.rope_type", rope["rope_type"], "only axial is supported")
        fields = {name: raw[name] for name in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                               "projection_intermediate_size", "patch_size", "temporal_patch_size",
                                               "spatial_merge_size", "in_channels", "rms_norm_eps", "swiglu_limit")
                  if name in raw}
        config = cls(**{"depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096,
                        "projection_intermediate_size": 10240, **fields},
                     out_hidden_size=raw.get("out_hidden_size", text_hidden_size),
                     rope_theta=float(rope.get("rope_theta", 10000.0)),
                     **{name: int(value) for name, value in (top or {}).items()
                        if name in ("image_token_id", "video_start_token_id", "video_end_token_id")})
        if config.out_hidden_size != text_hidden_size:
            raise ConfigError("vision_config.out_hidden_size", config.out_hidden_size,
                              f"must equal the text model's hidden_size {text_hidden_size}")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ConfigError("vision_config.num_heads", config.num_heads,
                              f"must split hidden_size {config.hidden_size} into heads of a multiple of 4")
        return config


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]
    mlp_kinds: tuple[MlpKind, ...]
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_always_select_tail: bool
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float
    swiglu_limit: float
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    quant: QuantConfig = field(default_factory=QuantConfig)
    vision: VisionConfig | None = None  # the multimodal config's tower; None for text-only configs
    # Multi-token-prediction layers after the decoder layers (indices num_layers..; the release has one): what
    # the config declares, whether or not the checkpoint stores them (the ModelOpt build does not).
    num_mtp_layers: int = 0

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "kda"]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "dsa"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.mlp_kinds) if k == "moe"]

    @property
    def linear_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def index_select_pools(self) -> int:
        return self.index_topk // self.index_kpool

    @classmethod
    def from_dir(cls, snapshot: Path | str) -> "ModelConfig":
        snapshot = Path(snapshot)
        raw = json.loads((snapshot / "config.json").read_text())
        gen_path = snapshot / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        return _parse(raw, generation or {})


def _parse(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    text = raw.get("text_config") or raw
    if not isinstance(text, dict):
        raise ConfigError("text_config", text, "must be an object")

    def get(name: str, default: Any = None, required: bool = True) -> Any:
        value = text.get(name, raw.get(name, default))
        if value is None and required:
            raise ConfigError(name, None, "is required")
        return value

    num_layers = int(get("num_hidden_layers"))
    linear_cfg = text.get("linear_attn_config") or raw.get("linear_attn_config") or {}
    layer_kinds = _layer_kinds(get("layer_types", required=False), linear_cfg, num_layers)
    mlp_kinds = _mlp_kinds(text, num_layers)

    qk_rope = int(get("qk_rope_head_dim", 0))
    if qk_rope != 0:
        raise ConfigError("qk_rope_head_dim", qk_rope, "glm5_next is NoPE; only 0 is supported")
    heads, kv_heads = int(get("num_attention_heads")), int(get("num_key_value_heads", get("num_attention_heads")))
    if heads != kv_heads:
        raise ConfigError("num_key_value_heads", kv_heads, f"must equal num_attention_heads ({heads})")
    indexer_types = get("indexer_types", required=False)
    if indexer_types and any(t != "full" for t in indexer_types):
        raise ConfigError("indexer_types", indexer_types, "only 'full' (one indexer per DSA layer) is supported")
    if get("n_group", 1) != 1 or get("topk_group", 1) != 1:
        raise ConfigError("n_group", get("n_group", 1), "grouped routing is not supported (released model uses 1)")
    if get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("scoring_func", get("scoring_func"), "only 'sigmoid' is supported")
    hc_mult = int(get("hc_mult", 4))
    if not get("mhc", True):
        raise ConfigError("mhc", False, "models without mHC are not glm5_next")
    kpool = int(get("index_kpool"))
    topk = int(get("index_topk"))
    if kpool < 1 or topk % kpool:
        raise ConfigError("index_kpool", kpool, f"must be positive and divide index_topk ({topk})")
    if get("index_kpool_compress", True) is False:
        raise ConfigError("index_kpool_compress", False, "uncompressed indexers are not supported")
    lower_bound = linear_cfg.get("gate_lower_bound", text.get("linear_lower_bound", -5.0))
    if lower_bound is None:
        raise ConfigError("gate_lower_bound", None, "the softplus KDA gate is not used by glm5_next")
    eos = generation.get("eos_token_id", get("eos_token_id", None, required=False))
    eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    experts = int(get("n_routed_experts"))
    top_k = int(get("num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise ConfigError("num_experts_per_tok", top_k, f"must be in 1..n_routed_experts ({experts})")

    return ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=num_layers,
        layer_kinds=layer_kinds,
        mlp_kinds=mlp_kinds,
        intermediate_size=int(get("intermediate_size")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=int(get("n_shared_experts", 1)),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        num_attention_heads=heads,
        q_lora_rank=int(get("q_lora_rank")),
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=topk,
        index_kpool=kpool,
        index_always_select_tail=bool(get("index_kpool_always_select_tail", True)),
        linear_num_heads=int(linear_cfg.get("num_heads", get("linear_num_heads", 64))),
        linear_head_dim=int(linear_cfg.get("head_dim", get("linear_head_dim", 128))),
        conv_kernel=int(linear_cfg.get("short_conv_kernel_size", get("linear_conv_kernel_dim", 4))),
        gate_lower_bound=float(lower_bound),
        hc_mult=hc_mult,
        hc_eps=float(get("hc_eps", 1e-6)),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        swiglu_limit=float(get("swiglu_limit", 10.0)),
        max_position_embeddings=int(get("max_position_embeddings", 1 << 20)),
        eos_token_ids=eos_ids,
        quant=_quant(raw.get("quantization_config") or text.get("quantization_config")),
        vision=VisionConfig.from_dict(raw.get("vision_config") if "text_config" in raw else None,
                                      int(get("hidden_size")), raw),
        num_mtp_layers=int(get("num_nextn_predict_layers", 0)),
    )


def _layer_kinds(layer_types: list[str] | None, linear_cfg: dict[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    from_lists: list[LayerKind] | None = None
    if "full_attn_layers" in linear_cfg or "kda_layers" in linear_cfg:
        dsa = set(linear_cfg.get("full_attn_layers", []))
        kda = set(linear_cfg.get("kda_layers", set(range(num_layers)) - dsa))
        if dsa & kda or (dsa | kda) != set(range(num_layers)):
            raise ConfigError("linear_attn_config", linear_cfg, "kda_layers and full_attn_layers must partition the layers")
        from_lists = ["dsa" if i in dsa else "kda" for i in range(num_layers)]
    if layer_types is None:
        if from_lists is None:
            raise ConfigError("layer_types", None, "needed when linear_attn_config has no layer lists")
        return tuple(from_lists)
    if len(layer_types) != num_layers:
        raise ConfigError("layer_types", layer_types, f"has {len(layer_types)} entries, num_hidden_layers is {num_layers}")
    kinds: list[LayerKind] = []
    for name in layer_types:
        if name in DSA_LAYER_NAMES:
            kinds.append("dsa")
        elif name in KDA_LAYER_NAMES:
            kinds.append("kda")
        else:
            raise ConfigError("layer_types", name, f"unknown layer type; expected one of {KDA_LAYER_NAMES + DSA_LAYER_NAMES}")
    if from_lists is not None and from_lists != kinds:
        raise ConfigError("layer_types", layer_types, "disagrees with linear_attn_config kda_layers/full_attn_layers")
    return tuple(kinds)


def _mlp_kinds(text: dict[str, Any], num_layers: int) -> tuple[MlpKind, ...]:
    mlp_types = text.get("mlp_layer_types")
    if mlp_types is not None:
        if len(mlp_types) != num_layers:
            raise ConfigError("mlp_layer_types", mlp_types, f"has {len(mlp_types)} entries, expected {num_layers}")
        mapping = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        for name in mlp_types:
            if name not in mapping:
                raise ConfigError("mlp_layer_types", name, "expected 'dense' or 'sparse'")
        return tuple(mapping[name] for name in mlp_types)  # type: ignore[misc]
    first_dense = text.get("first_k_dense_replace")
    if first_dense is None:
        raise ConfigError("mlp_layer_types", None, "needed when first_k_dense_replace is absent")
    freq = int(text.get("moe_layer_freq", 1))
    return tuple("dense" if i < first_dense or i % freq else "moe" for i in range(num_layers))


def _quant(qc: dict[str, Any] | None) -> QuantConfig:
    if not qc:
        return QuantConfig()
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ConfigError("quantization_config.weight_block_size", block, "fp8 needs a [n, k] block size")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError("quantization_config.fmt", qc.get("fmt"), "only e4m3 is supported")
        return QuantConfig("fp8_block", block_size=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        formats = {fmt} | {g.get("format") for g in groups.values() if g.get("format")}
        formats.discard(None)
        if formats != {"nvfp4-pack-quantized"}:
            raise ConfigError("quantization_config.format", sorted(formats), "only nvfp4-pack-quantized is supported")
        sizes = {int((g.get("weights") or {}).get("group_size", 16)) for g in groups.values()} or {16}
        if sizes != {16}:
            raise ConfigError("quantization_config.group_size", sorted(sizes), "NVFP4 uses groups of 16")
        return QuantConfig("nvfp4_ct")
    if method == "modelopt":
        algo = str(qc.get("quant_algo", (qc.get("quantization") or {}).get("quant_algo", ""))).upper()
        if algo != "NVFP4":
            raise ConfigError("quantization_config.quant_algo", algo, "only NVFP4 ModelOpt checkpoints are supported")
        group = int(qc.get("group_size", 16))
        if group != 16:
            raise ConfigError("quantization_config.group_size", group, "NVFP4 uses groups of 16")
        return QuantConfig("nvfp4_modelopt")
    raise ConfigError("quantization_config.quant_method", qc.get("quant_method"),
                      "supported: fp8 (block), compressed-tensors (nvfp4-pack-quantized), modelopt (NVFP4)")
