"""ops/slice_snapshot.py sizes its full-width slices from the bytes each release format really stores."""

from __future__ import annotations

import math

import pytest
import torch

from engine.checkpoint.layout import text_specs, vision_specs
from engine.config import ModelConfig
from engine.tiny.factory import encode, init_value
from engine.tiny.tokenizer import build_tokenizer
from ops.slice_snapshot import FULL_EXPERTS, MIN_EXPERTS, plan_slice, slice_config, stored_bytes, text_only_head


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
def test_stored_bytes_match_the_encoded_entries(fmt):
    cfg = ModelConfig.from_dict(slice_config(fmt, 4, MIN_EXPERTS))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size) == (4096, 154880, 2048)
    generator = torch.Generator().manual_seed(0)
    picked = {}
    for spec in text_specs(cfg):  # one of each role and storage, the expert and a DSA projection among them
        kind = (spec.role, spec.is_expert, "self_attn.q_b_proj" in spec.name)
        if kind not in picked and spec.name != "embed_tokens.weight" and spec.name != "lm_head":
            picked[kind] = spec
    for spec in picked.values():
        entries = encode(spec, init_value(spec, generator), fmt, cfg)
        found = sum(t.numel() * t.element_size() for k, t in entries.items() if not k.endswith("input_scale"))
        assert stored_bytes(spec, fmt, cfg) == found, spec.name


def test_slices_grow_by_layers_then_shrink_by_experts():
    assert plan_slice(190 * 2**30, "nvfp4-ct") == (45, FULL_EXPERTS)  # the release: 45 layers, ~181 GiB
    layers, experts = plan_slice(20 * 2**30, "nvfp4-ct")
    assert experts == FULL_EXPERTS and 1 < layers < 45
    assert plan_slice(3 * 2**30, "nvfp4-ct") == (1, pytest.approx(25, abs=3))
    assert plan_slice(1, "nvfp4-ct") == (1, MIN_EXPERTS)


def test_a_fixed_depth_sizes_the_experts_to_fit():
    layers, experts = plan_slice(12 * 2**30, "nvfp4-ct", layers=12)
    cfg = ModelConfig.from_dict(slice_config("nvfp4-ct", layers, experts))
    grown = ModelConfig.from_dict(slice_config("nvfp4-ct", layers, experts + 1))
    total = sum(stored_bytes(s, "nvfp4-ct", cfg) for s in text_specs(cfg))
    assert layers == 12 and MIN_EXPERTS < experts < FULL_EXPERTS
    assert total <= 12 * 2**30 < sum(stored_bytes(s, "nvfp4-ct", grown) for s in text_specs(grown))
    assert cfg.dsa_layers == [3, 7, 11]  # the release's 3:1 KDA:DSA mix
    assert plan_slice(1, "nvfp4-ct", layers=12) == (12, MIN_EXPERTS)
    assert plan_slice(10**15, "nvfp4-ct", layers=3) == (3, FULL_EXPERTS)


def test_greedy_tokens_of_the_head_decode_to_text():
    generator = torch.Generator().manual_seed(0)
    value = torch.randn(1000, 64, generator=generator)  # more ids than the tokenizer has, as in the release
    head = text_only_head(value)
    assert torch.equal(head[0x20:0x7F], value[0x20:0x7F]) and not head[:0x20].any() and not head[0x7F:].any()
    hidden = torch.randn(256, 64, generator=generator)
    text = build_tokenizer().decode((hidden @ head.T).argmax(-1).tolist())
    assert len(text) == 256 and text.isascii() and text.isprintable()


def test_a_slice_with_the_vision_tower_has_the_release_tower_and_the_tiny_tokenizer_image_token():
    cfg = ModelConfig.from_dict(slice_config("nvfp4-ct", 2, MIN_EXPERTS, vision=True))
    assert (cfg.vision.depth, cfg.vision.hidden_size, cfg.vision.out_hidden_size) == (24, 1024, 4096)
    tokenizer = build_tokenizer()
    assert tokenizer.token_to_id("<|image|>") == cfg.vision.image_token_id
    assert tokenizer.token_to_id("<|begin_of_video|>") == cfg.vision.video_start_token_id
    tower_bytes = sum(2 * math.prod(s.shape) for s in vision_specs(cfg))  # BF16
    assert 1.0e9 < tower_bytes < 1.2e9
    assert ModelConfig.from_dict(slice_config("nvfp4-ct", 2, MIN_EXPERTS)).vision is None
