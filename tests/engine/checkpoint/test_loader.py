"""Loading real-layout snapshots: formats stay packed, bad snapshots fail naming the tensor or file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.loader import CheckpointError, load_weights
from engine.config import ConfigError, ModelConfig
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight

EXPERT = "model.language_model.layers.2.mlp.experts.5.up_proj"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_shard(snapshot: Path, key: str, change) -> None:
    """Apply change(tensors) to the shard holding `key` (the index stays as it is)."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shard = snapshot / index["weight_map"][key]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(shard))


def load(snapshot: Path):
    return load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.float32)


@pytest.mark.parametrize("fmt,kind", [("bf16", DenseWeight), ("fp8", Fp8BlockWeight), ("nvfp4-ct", Nvfp4Weight),
                                      ("nvfp4-modelopt", Nvfp4Weight)])
def test_experts_stay_packed_and_fp32_tensors_stay_fp32(tiny_dir, fmt, kind):
    w = load(tiny_dir(fmt))
    up = w["layers.2.mlp.experts.up_proj"]
    assert isinstance(up, kind) and up.shape == (16, 96, 192)
    if kind is Nvfp4Weight:
        assert up.packed.dtype == torch.uint8 and up.packed.shape == (16, 96, 96)
        assert up.scale.dtype == torch.float8_e4m3fn and up.global_scale.shape == (16, 1)
    if kind is Fp8BlockWeight:
        assert up.data.dtype == torch.float8_e4m3fn and up.scale_inv.shape == (16, 1, 2)
        assert isinstance(w["layers.3.self_attn.q_b_proj"], Fp8BlockWeight)
        assert isinstance(w["layers.3.self_attn.kv_b_proj"], DenseWeight)
    for name in ("layers.0.hc_attn_base", "layers.0.self_attn.A_log", "layers.0.self_attn.dt_bias",
                 "layers.1.mlp.gate.e_score_correction_bias", "layers.3.self_attn.indexer.index_kpool_compress_ape"):
        assert w[name].dtype == torch.float32, name


def test_expert_stack_matches_the_per_expert_tensor(tiny_dir):
    snapshot = tiny_dir("nvfp4-modelopt")
    w = load(snapshot)["layers.2.mlp.experts.up_proj"]
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(snapshot / index[EXPERT + ".weight"]), "pt") as f:
        assert torch.equal(w.packed[5], f.get_tensor(EXPERT + ".weight"))
        assert torch.equal(w.global_scale[5], f.get_tensor(EXPERT + ".weight_scale_2").reshape(1))


def test_bf16_copies_of_fp32_tensors_are_upcast(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("bf16"), tmp_path / "s")
    key = "model.language_model.layers.1.mlp.gate.e_score_correction_bias"
    rewrite_shard(snapshot, key, lambda t: t.update({key: t[key].to(torch.bfloat16)}))
    assert load(snapshot)["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_single_file_snapshot_loads_the_vision_tower_and_skips_mtp(tiny_dir, tmp_path):
    src = tiny_dir("bf16")
    dst = tmp_path / "one"
    dst.mkdir()
    tensors = {}
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    tensors["model.language_model.layers.8.eh_proj.weight"] = torch.zeros(2, 4)  # MTP layer
    tensors["model.language_model.layers.8.shared_head.norm.weight"] = torch.zeros(2)
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    w = load(dst)
    assert not any(k.startswith("layers.8.") for k in w)
    assert torch.equal(w["norm.weight"], tensors["model.language_model.norm.weight"].float())
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    assert torch.equal(w["visual.blocks.0.attn.qkv.weight"], tensors[qkv].float())
    tensors[qkv] = torch.zeros(3, 2)
    save_file(tensors, str(dst / "model.safetensors"))
    message = r"'visual.blocks.0.attn.qkv.weight': expected shape \[96, 32\], found \[3, 2\]"
    with pytest.raises(CheckpointError, match=message):
        load(dst)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("bf16"), tmp_path / "s")
    key = "model.language_model.layers.3.self_attn.indexer.index_kpool_compress_gate"
    rewrite_shard(snapshot, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"missing tensor .*index_kpool_compress_gate.*\[32, 192\]"):
        load(snapshot)


def test_wrong_shape_names_expected_and_found(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("fp8"), tmp_path / "s")
    key = "model.language_model.layers.3.self_attn.q_b_proj.weight_scale_inv"
    rewrite_shard(snapshot, key, lambda t: t.update({key: torch.ones(2, 2)}))
    with pytest.raises(CheckpointError, match=r"q_b_proj.weight_scale_inv.*expected shape \[1, 1\], found \[2, 2\]"):
        load(snapshot)


def test_extra_tensor_is_refused(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("bf16"), tmp_path / "s")
    key = "model.language_model.norm.weight"
    rewrite_shard(snapshot, key, lambda t: t.update({"model.language_model.layers.0.surprise.weight": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.language_model.layers.0.surprise.weight'"):
        load(snapshot)


def test_incomplete_quantized_tensor_is_named(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("nvfp4-ct"), tmp_path / "s")
    key = EXPERT + ".weight_global_scale"
    rewrite_shard(snapshot, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"experts.5.up_proj.*match no known format"):
        load(snapshot)


def test_truncated_file_is_named(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("bf16"), tmp_path / "s")
    shard = sorted(snapshot.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        load(snapshot)


def test_unknown_quant_method_is_refused(tiny_dir, tmp_path):
    snapshot = copy(tiny_dir("bf16"), tmp_path / "s")
    config = json.loads((snapshot / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quant_method' = 'gptq'"):
        ModelConfig.from_dir(snapshot)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
def test_parallel_chunked_read_matches_the_safetensors_library(tiny_dir, fmt, monkeypatch):
    """Chunks and staging buffers a few KiB large: weights whose parts straddle two chunks, tensors larger
    than a staging buffer read in pieces by several threads, skipped activation scales read through; every
    byte must equal what the safetensors library reads, put together the same way."""
    import engine.checkpoint.shards as shards
    from engine.checkpoint.layout import checkpoint_key, text_specs, vision_specs
    from engine.checkpoint.loader import IGNORED_SUFFIXES, assemble

    monkeypatch.setattr(shards, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(shards, "STAGING_BYTES", 3 * 4096)
    snapshot = tiny_dir(fmt)
    cfg = ModelConfig.from_dir(snapshot)
    seen = []
    got = load_weights(snapshot, cfg, "cpu", torch.float32, workers=4, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] and len(seen) > 50

    stored = {}
    for shard in snapshot.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})

    def groups():
        for spec in [*text_specs(cfg), *vision_specs(cfg)]:
            base = checkpoint_key(spec.name)
            if spec.role != "linear":
                yield spec, {"": stored[base]}
                continue
            parts = {k[len(base) + 1:]: t for k, t in stored.items() if k.startswith(base + ".")}
            yield spec, {s: t for s, t in parts.items() if "." not in s and s not in IGNORED_SUFFIXES}

    want = assemble(cfg, groups(), "cpu", torch.float32)
    assert got.keys() == want.keys()
    for name, weight in want.items():
        tensors = [weight] if isinstance(weight, torch.Tensor) else [getattr(weight, f) for f in vars(weight)
                                                                    if isinstance(getattr(weight, f), torch.Tensor)]
        mine = [got[name]] if isinstance(got[name], torch.Tensor) else [getattr(got[name], f) for f in vars(weight)
                                                                         if isinstance(getattr(weight, f), torch.Tensor)]
        for a, b in zip(mine, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_a_load_says_whether_reading_or_converting_took_its_time(tiny_dir, caplog):
    """`event=load_timing`: per thread, the seconds in reads, waiting for a staging buffer and in converting and
    placing, next to the wall time (a reader cannot have spent more than the wall reading and waiting, nor a
    consumer more than the wall converting; reads and conversions overlap)."""
    cfg = ModelConfig.from_dir(tiny_dir("nvfp4-ct"))
    with caplog.at_level("INFO", logger="glmflash.engine"):
        load_weights(tiny_dir("nvfp4-ct"), cfg, workers=2)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("event=load_timing"))
    fields = dict(part.split("=") for part in line.split()[1:])
    assert fields["threads"] == "2"
    read, wait, consume = float(fields["read_s"]), float(fields["wait_s"]), float(fields["consume_s"])
    wall = float(fields["wall_s"])
    assert read + consume > 0 and read + wait <= wall + 0.002 and consume <= wall + 0.002


def test_read_timing_adds_up_from_several_threads():
    import threading
    import time

    from engine.checkpoint.shards import ReadTiming

    timing = ReadTiming()

    def work() -> None:
        with timing.timed("read_s"):
            time.sleep(0.05)
        with timing.timed("consume_s"):
            time.sleep(0.02)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.2 <= timing.read_s < 0.4 and 0.08 <= timing.consume_s < 0.25
    assert timing.summary(0.1, 4).startswith("wall_s=0.100 threads=4 read_s=0.0")
