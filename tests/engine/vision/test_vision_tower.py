"""The vision tower against transformers' `Glm5NextVisionModel` on a small random tower: the merged
embeddings of several images of different grids packed in one call (each attends only to itself), in float32
closely and in bf16 within what transformers itself loses in bf16; and the config's checks."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next import configuration_glm5_next as configuration
from transformers.models.glm5_next import modeling_glm5_next as modeling

from engine.config import ConfigError
from engine.model.vision import VisionConfig, VisionTower, vision_weights

RAW = {"model_type": "glm5_next_vision", "depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 96,
       "out_hidden_size": 48, "projection_intermediate_size": 80, "patch_size": 14, "spatial_merge_size": 2,
       "temporal_patch_size": 2, "swiglu_limit": 2.0}
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]  # three images, packed


def reference_tower(dtype: torch.dtype, seed: int = 0):
    """transformers' tower with every parameter random (norm weights near 1, biases non-zero), so a missed
    bias, norm or clamp shows."""
    torch.manual_seed(seed)
    model = modeling.Glm5NextVisionModel(configuration.Glm5NextVisionConfig(**RAW)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * (1.0 / param[0].numel() ** 0.5 if param.dim() > 1 else 0.3))
    return model.to(dtype)


def pixels(seed: int = 1) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))


def ours(model, dtype: torch.dtype) -> torch.Tensor:
    config = VisionConfig.from_dict(RAW, text_hidden_size=48)
    weights = vision_weights({f"model.visual.{k}": v.to(dtype) for k, v in model.state_dict().items()})
    return VisionTower(config, weights)(pixels(), GRIDS)


def theirs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(pixels().to(next(model.parameters()).dtype), grid_thw=torch.tensor(GRIDS)).pooler_output


def test_float32_matches_transformers():
    model = reference_tower(torch.float32)
    expected, got = theirs(model), ours(model, torch.float32)
    assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 48)
    assert expected.abs().mean() > 0.1  # a tower whose output is not all near zero
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_each_image_attends_only_to_itself():
    model = reference_tower(torch.float32)
    config = VisionConfig.from_dict(RAW, text_hidden_size=48)
    tower = VisionTower(config, vision_weights({f"visual.{k}": v for k, v in model.state_dict().items()}))
    packed = tower(pixels(), GRIDS)
    first = sum(t * h * w for t, h, w in GRIDS[:1])
    alone = tower(pixels()[first:first + 4], GRIDS[1:2])
    torch.testing.assert_close(packed[first // 4:first // 4 + 1], alone, rtol=1e-5, atol=1e-6)


def test_bf16_within_transformers_own_bf16_error():
    reference = theirs(reference_tower(torch.float32)).double()
    their_error = (theirs(reference_tower(torch.bfloat16)).double() - reference).abs().mean()
    our_error = (ours(reference_tower(torch.float32), torch.bfloat16).double() - reference).abs().mean()
    assert our_error <= 1.5 * their_error + 1e-6, (our_error, their_error)


def test_missing_tensors_are_named():
    model = reference_tower(torch.float32)
    weights = vision_weights({f"model.visual.{k}": v for k, v in model.state_dict().items()})
    del weights["blocks.1.attn.qkv.bias"]
    with pytest.raises(ValueError, match="missing tensors model.visual.blocks.1.attn.qkv.bias"):
        VisionTower(VisionConfig.from_dict(RAW, text_hidden_size=48), weights)


def test_config_checks():
    assert VisionConfig.from_dict(None, 48) is None
    assert VisionConfig.from_dict({"out_hidden_size": 4096}, 4096).depth == 24  # the release's defaults
    with pytest.raises(ConfigError, match="out_hidden_size"):
        VisionConfig.from_dict(RAW, text_hidden_size=64)
    with pytest.raises(ConfigError, match="rope_type"):
        VisionConfig.from_dict({**RAW, "rope_parameters": {"rope_type": "default"}}, 48)
