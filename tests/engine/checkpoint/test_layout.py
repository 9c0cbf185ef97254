"""The layout table at the released model's size matches the published parameter counts."""

from __future__ import annotations

import math

from engine.checkpoint.layout import quantized_in_release, text_specs
from engine.config import ModelConfig

RELEASED = {  # zai-org/GLM-5.3-Flash config.json, nested form, as the spec lists it
    "model_type": "glm5_next",
    "architectures": ["Glm5NextForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45,
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0, "v_head_dim": 256, "mla_use_nope": True, "rope_theta": None,
        "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1, "swiglu_limit": 10.0,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_kpool": 4,
        "index_kpool_compress": True, "index_kpool_always_select_tail": True,
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0,
                               "kda_layers": [i for i in range(45) if i % 4 != 3],
                               "full_attn_layers": [i for i in range(45) if i % 4 == 3]},
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "mhc": True, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    },
    "vision_config": {"model_type": "glm5_next_vision", "depth": 24, "hidden_size": 1024},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
}
GENERATION = {"eos_token_id": [154820, 154827, 154829]}


def test_released_config_parses_to_the_published_structure():
    cfg = ModelConfig.from_dict(RELEASED, GENERATION)
    assert (len(cfg.dsa_layers), len(cfg.kda_layers)) == (11, 34)
    assert cfg.dsa_layers == list(range(3, 45, 4))
    assert cfg.mlp_kinds[:3] == ("dense",) * 3 and len(cfg.moe_layers) == 42
    assert (cfg.index_kpool, cfg.index_select_pools, cfg.linear_dim) == (4, 512, 8192)
    assert cfg.quant.method == "fp8_block" and cfg.eos_token_ids == (154820, 154827, 154829)


def test_layout_parameter_counts_match_the_spec():
    cfg = ModelConfig.from_dict(RELEASED, GENERATION)
    specs = list(text_specs(cfg))
    count = {s.name: math.prod(s.shape) for s in specs}
    experts = sum(n for name, n in count.items() if ".mlp.experts." in name)
    rest = sum(n for name, n in count.items() if ".mlp.experts." not in name)
    assert abs(experts / 304.41e9 - 1) < 1e-3  # 42 x 288 x 25.17 M
    assert abs(rest / 8.92e9 - 1) < 5e-3
    kda = sum(n for name, n in count.items() if name.startswith("layers.0.self_attn."))
    dsa = sum(n for name, n in count.items() if name.startswith("layers.3.self_attn."))
    assert abs(kda / 137.7e6 - 1) < 2e-3 and abs(dsa / 124.9e6 - 1) < 2e-3


def test_release_quantization_rules():
    cfg = ModelConfig.from_dict(RELEASED, GENERATION)
    specs = {s.name: s for s in text_specs(cfg)}
    fp8 = {name for name, s in specs.items() if quantized_in_release(cfg, s)}
    assert "layers.3.self_attn.q_b_proj" in fp8 and "layers.3.self_attn.o_proj" in fp8
    assert "layers.3.self_attn.kv_b_proj" not in fp8 and "layers.0.self_attn.o_proj" not in fp8  # KDA stays BF16
    assert "layers.5.mlp.experts.7.down_proj" in fp8 and "layers.0.mlp.gate_proj" in fp8
    assert "lm_head" not in fp8 and "layers.3.self_attn.indexer.wq_b" not in fp8
