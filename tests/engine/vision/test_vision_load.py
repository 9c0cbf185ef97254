"""The vision tower from the checkpoint: `model.visual.*` loaded in every release format (BF16 in each) and
through the prepared snapshot, the tower built from the loaded tensors equal to transformers' on the same
snapshot; a checkpoint without the tower loads for text alone and says so; a partial tower is refused naming
the missing tensor."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.loader import load_weights
from engine.checkpoint.prepared import load_prepared, save_prepared
from engine.checkpoint.shards import CheckpointError
from engine.config import ModelConfig
from engine.model.vision import VisionTower, vision_weights
from engine.tiny.factory import write_tiny_model
from tests.engine.conftest import FORMATS, load_reference

GRIDS = [(1, 4, 6), (1, 2, 2)]


def pixels() -> torch.Tensor:
    return torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))


def tower(weights: dict, cfg: ModelConfig) -> torch.Tensor:
    return VisionTower(cfg.vision, vision_weights(weights))(pixels(), GRIDS)


def rewrite_shards(snapshot: Path, keep) -> None:
    """Drop the checkpoint entries `keep` refuses, shard files and index alike."""
    index_path = snapshot / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(snapshot / name))
        save_file({k: v for k, v in tensors.items() if keep(k)}, str(snapshot / name), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if keep(k)}
    index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def bf16_snapshot(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("vision") / "bf16", "bf16")


def test_the_loaded_tower_equals_transformers(bf16_snapshot):
    cfg = ModelConfig.from_dir(bf16_snapshot)
    reference = load_reference(bf16_snapshot, torch.float32).model.visual
    with torch.no_grad():
        expected = reference(pixels(), grid_thw=torch.tensor(GRIDS)).pooler_output
    got = tower(load_weights(bf16_snapshot, cfg, "cpu", torch.float32), cfg)
    assert expected.abs().mean() > 0.05
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_every_format_loads_the_same_tower(tmp_path, bf16_snapshot, fmt):
    cfg = ModelConfig.from_dir(bf16_snapshot)
    plain = load_weights(bf16_snapshot, cfg, "cpu", torch.bfloat16)
    expected = {k: v for k, v in plain.items() if k.startswith("visual.")}
    snapshot = write_tiny_model(tmp_path / fmt, fmt)
    loaded = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    got = {k: v for k, v in loaded.items() if k.startswith("visual.")}
    assert sorted(got) == sorted(expected) and len(got) == 5 + 6 + 14 * cfg.vision.depth
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_the_prepared_snapshot_keeps_the_tower(tmp_path, bf16_snapshot):
    cfg = ModelConfig.from_dir(bf16_snapshot)
    weights = load_weights(bf16_snapshot, cfg, "cpu", torch.bfloat16)
    save_prepared(weights, tmp_path / "prepared")
    again, _ = load_prepared(tmp_path / "prepared")
    assert torch.equal(tower(again, cfg), tower(weights, cfg))


def test_a_checkpoint_without_the_tower_serves_text_and_says_so(tmp_path, caplog):
    snapshot = write_tiny_model(tmp_path / "text-only", "bf16")
    rewrite_shards(snapshot, lambda key: not key.startswith("model.visual."))
    with caplog.at_level(logging.INFO, logger="glmflash.engine"):
        weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.float32)
    assert not [k for k in weights if k.startswith("visual.")] and "embed_tokens.weight" in weights
    assert "event=vision_tower present=0" in caplog.text


def test_a_partial_tower_is_refused_naming_the_missing_tensor(tmp_path):
    snapshot = write_tiny_model(tmp_path / "partial", "bf16")
    rewrite_shards(snapshot, lambda key: key != "model.visual.blocks.1.attn.qkv.bias")
    message = r"missing tensor 'model.visual.blocks.1.attn.qkv.bias' \(expected shape \[96\]\)"
    with pytest.raises(CheckpointError, match=message):
        load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.float32)
