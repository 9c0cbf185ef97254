"""The prepared snapshot round-trips every weight format bit-exactly and detects damage."""

from __future__ import annotations

import torch
import pytest

from engine.checkpoint.loader import load_weights
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version, load_prepared, save_prepared
from engine.config import ModelConfig
from provision.errors import ProvisionError
from provision.prepared_store import ALIGN, check_prepared, read_plan


def buffers(weight):
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [v for v in vars(weight).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
def test_round_trip_is_exact(tiny_dir, tmp_path, fmt):
    snapshot = tiny_dir(fmt)
    weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    plan = save_prepared(weights, tmp_path / "prepared")
    assert list(plan.files)[0] == "dense.bin" and all(r.offset % ALIGN == 0 for r in plan.regions)
    assert check_prepared(tmp_path / "prepared", FORMAT_VERSION, engine_version()) == []
    loaded, stats = load_prepared(tmp_path / "prepared", workers=4)
    assert stats.bytes == sum(r.size for r in plan.regions)
    assert loaded.keys() == weights.keys()
    for name, weight in weights.items():
        assert type(loaded[name]) is type(weight), name
        for a, b in zip(buffers(loaded[name]), buffers(weight)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_damage_and_version_changes_are_reported(tiny_dir, tmp_path):
    snapshot = tiny_dir("nvfp4-ct")
    save_prepared(load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16), tmp_path)
    plan = read_plan(tmp_path)
    region = next(r for r in plan.regions if r.file.startswith("experts"))
    path = tmp_path / region.file
    data = bytearray(path.read_bytes())
    data[region.offset + 5] ^= 0x10  # one flipped bit, same size: only the hash can tell
    path.write_bytes(bytes(data))
    assert check_prepared(tmp_path, FORMAT_VERSION, engine_version()) == []
    with pytest.raises(ProvisionError, match=f"checksum mismatch in {region.key}"):
        load_prepared(tmp_path)
    assert "this is 9.9" in check_prepared(tmp_path, FORMAT_VERSION, "9.9")[0]
    path.write_bytes(bytes(data[:-100]))
    assert any(region.file in p and "bytes" in p for p in check_prepared(tmp_path, FORMAT_VERSION, engine_version()))
