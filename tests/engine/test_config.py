"""config.json in every form real snapshots use, and errors that name the field and value."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from engine.config import ConfigError, ModelConfig
from engine.tiny.factory import tiny_config


def text(**changes):
    cfg = copy.deepcopy(tiny_config()["text_config"])
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def test_nested_and_flat_forms_agree():
    nested = ModelConfig.from_dict(tiny_config())
    flat = ModelConfig.from_dict({"model_type": "glm5_next", **tiny_config()["text_config"]})
    assert dataclasses.replace(nested, vision=None) == flat  # the text model's fields
    assert nested.vision is not None and flat.vision is None  # a flat re-export carries no tower
    assert nested.layer_kinds == ("kda",) * 3 + ("dsa",) + ("kda",) * 3 + ("dsa",)
    assert nested.mlp_kinds == ("dense",) + ("moe",) * 7
    assert nested.index_kpool == 4 and nested.linear_num_heads == 4 and nested.gate_lower_bound == -5.0


@pytest.mark.parametrize("name", ["deepseek_sparse_attention", "full_attention", "indexed_attention"])
def test_dsa_layer_names(name):
    types = ["linear_attention", "linear_attention", "linear_attention", name] * 2
    assert ModelConfig.from_dict({"text_config": text(layer_types=types)}).dsa_layers == [3, 7]


def test_layer_kinds_from_linear_attn_config_alone():
    cfg = ModelConfig.from_dict({"text_config": text(layer_types=None)})
    assert cfg.dsa_layers == [3, 7] and len(cfg.kda_layers) == 6


def test_layer_lists_must_agree_with_layer_types():
    lac = text()["linear_attn_config"] | {"full_attn_layers": [3, 6], "kda_layers": [0, 1, 2, 4, 5, 7]}
    with pytest.raises(ConfigError, match="layer_types.*disagrees"):
        ModelConfig.from_dict({"text_config": text(linear_attn_config=lac)})


def test_mlp_kinds_from_first_k_dense_replace():
    cfg = ModelConfig.from_dict({"text_config": text(mlp_layer_types=None, first_k_dense_replace=3)})
    assert cfg.mlp_kinds == ("dense",) * 3 + ("moe",) * 5


def test_linear_attn_config_overrides_flat_fields():
    lac = text()["linear_attn_config"] | {"gate_lower_bound": -3.0}
    cfg = ModelConfig.from_dict({"text_config": text(linear_attn_config=lac, linear_num_heads=99)})
    assert cfg.gate_lower_bound == -3.0 and cfg.linear_num_heads == 4


@pytest.mark.parametrize("changes,field", [
    ({"index_kpool": None}, "index_kpool"),  # never fall back to a class default (transformers says 16)
    ({"index_kpool": 5}, "index_kpool"),
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
    ({"layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"mlp_layer_types": ["dense"] * 7 + ["mixture"]}, "mlp_layer_types"),
    ({"indexer_types": ["full", "shared"] * 4}, "indexer_types"),
    ({"n_group": 8}, "n_group"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
])
def test_bad_fields_are_named(changes, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"text_config": text(**changes)})
    assert err.value.field_name == field
    assert field in str(err.value)


@pytest.mark.parametrize("fmt,method", [("bf16", "none"), ("fp8", "fp8_block"), ("nvfp4-ct", "nvfp4_ct"),
                                        ("nvfp4-modelopt", "nvfp4_modelopt")])
def test_quantization_configs(fmt, method):
    assert ModelConfig.from_dict(tiny_config(fmt)).quant.method == method


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "awq"}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "weight_block_size": None}, "quantization_config.weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "quantization_config.format"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quantization_config.quant_algo"),
])
def test_bad_quantization_configs(qc, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"text_config": text(), "quantization_config": qc})
    assert err.value.field_name == field


def test_eos_ids_come_from_generation_config():
    cfg = ModelConfig.from_dict(tiny_config(), {"eos_token_id": [154820, 154827, 154829]})
    assert cfg.eos_token_ids == (154820, 154827, 154829)
