"""Tiny snapshots in every format, their dequantized twins, and the transformers reference model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoint.quant import dequantize_fp8_block, dequantize_nvfp4
from engine.tiny.factory import write_tiny_model

FORMATS = ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(fmt, **overrides) -> snapshot path, written once per distinct request."""
    made: dict[tuple, Path] = {}

    def make(fmt: str = "bf16", seed: int = 0, **overrides) -> Path:
        key = (fmt, seed, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{fmt}"), fmt, seed, **overrides)
        return made[key]

    return make


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The same snapshot with every quantized linear expanded to float32 and no quantization_config.

    Written independently of the engine's loader (only the codecs, which are checked against
    compressed-tensors), so the reference sees exactly the weights the checkpoint encodes.
    """
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.endswith(".weight_scale_inv"):
            base = key[: -len("_scale_inv")]
            out[base] = dequantize_fp8_block(tensors[base], value)
        elif key.endswith(".weight_packed"):
            base = key[: -len("_packed")]
            glob = tensors[base + "_global_scale"].float().reciprocal().reshape(1)
            out[base] = dequantize_nvfp4(value, tensors[base + "_scale"], glob)
        elif key.endswith(".weight_scale_2"):
            base = key[: -len("_scale_2")]
            out[base] = dequantize_nvfp4(tensors[base], tensors[base + "_scale"], value.float().reshape(1))
        elif not key.endswith((".weight_scale", ".weight_global_scale", ".input_scale")) and key not in out:
            out[key] = value
    for key in list(out):  # quantized weights were written above; drop their raw packed twins
        if out[key].dtype in (torch.uint8, torch.float8_e4m3fn):
            raise AssertionError(f"{key} left packed")
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(snapshot) -> transformers Glm5NextForConditionalGeneration in float32 on the dequantized weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging

    logging.set_verbosity_error()
    cache: dict[Path, object] = {}

    def load(snapshot: Path):
        if snapshot not in cache:
            plain = dequantized_copy(snapshot, tmp_path_factory.mktemp("dequantized"))
            model = transformers.Glm5NextForConditionalGeneration.from_pretrained(plain, dtype=torch.float32)
            cache[snapshot] = model.eval()
        return cache[snapshot]

    return load


@pytest.fixture(scope="session")
def prompt():
    """prompt(length, seed) -> random token ids inside the tiny tokenizer's vocabulary."""

    def make(length: int, seed: int = 0) -> list[int]:
        return torch.randint(0, 283, (length,), generator=torch.Generator().manual_seed(seed)).tolist()

    return make
