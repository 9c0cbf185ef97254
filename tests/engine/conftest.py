"""Tiny snapshots in every format, their dequantized twins, and the transformers reference model."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.kernels.dispatch import kernel, register
from engine.quant import dequantize_fp8_block, dequantize_nvfp4
from engine.tiny.factory import write_tiny_model

if TYPE_CHECKING:  # imported where used: transformers takes seconds to import, most tests never need it
    from transformers import Glm5NextForConditionalGeneration

    from engine.engine_core import EngineCore
    from engine.sequence import Sequence
    from engine.vision.preprocess import ProcessedImage

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


# Bound to fla's Triton kernels when fla is installed; those need a GPU, and the reference is the spec's
# own PyTorch code on every machine.
FALLBACK_KERNELS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update")


def use_reference_kernels() -> None:
    """Make transformers' glm5_next run its plain PyTorch implementations (idempotent)."""
    from transformers.models.glm5_next import modeling_glm5_next

    for name in FALLBACK_KERNELS:
        fn = getattr(modeling_glm5_next, name)
        setattr(modeling_glm5_next, name, getattr(fn, "__wrapped__", fn))


def load_reference(plain: Path, dtype: torch.dtype) -> Glm5NextForConditionalGeneration:
    """transformers' glm5_next on a dequantized snapshot, in eval mode on CPU."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging

    use_reference_kernels()
    logging.set_verbosity_error()
    return Glm5NextForConditionalGeneration.from_pretrained(plain, dtype=dtype).eval()


@dataclass(frozen=True)
class Outputs:
    """One forward pass over a token sequence: the mHC streams after each decoder layer, and fp32 logits."""

    layers: list[torch.Tensor]
    logits: torch.Tensor


def reference_outputs(model: Glm5NextForConditionalGeneration, ids: list[int],
                      images: list[ProcessedImage] = ()) -> Outputs:
    """With `images`: `ids` hold each image's full run of image tokens, in order."""
    layers: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: layers.append(out[0][0]))
             for layer in model.model.language_model.layers]
    try:
        with torch.no_grad():
            pixels = {"pixel_values": torch.cat([image.pixel_values for image in images]),
                      "image_grid_thw": torch.tensor([image.grid_thw for image in images])} if images else {}
            logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    return Outputs(layers, logits)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(snapshot, dtype=float32) -> transformers' model on the snapshot's dequantized weights."""
    plain: dict[Path, Path] = {}
    models: dict[tuple[Path, torch.dtype], Glm5NextForConditionalGeneration] = {}

    def load(snapshot: Path, dtype: torch.dtype = torch.float32):
        if snapshot not in plain:
            plain[snapshot] = dequantized_copy(snapshot, tmp_path_factory.mktemp("dequantized"))
        if (snapshot, dtype) not in models:
            models[snapshot, dtype] = load_reference(plain[snapshot], dtype)
        return models[snapshot, dtype]

    return load


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """Random token ids inside the tiny tokenizer's vocabulary."""
    return torch.randint(0, 283, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextmanager
def count_kernel_calls(ops: tuple[str, ...]) -> Iterator[Counter]:
    """Calls of these ops' torch implementations inside the block: how often a step launches each."""
    calls: Counter = Counter()
    originals = {op: kernel(op, "cpu") for op in ops}

    def counted(op: str):
        def call(*args, **kwargs):
            calls[op] += 1
            return originals[op](*args, **kwargs)
        return call

    for op in ops:
        register(op, "torch")(counted(op))
    try:
        yield calls
    finally:
        for op, fn in originals.items():
            register(op, "torch")(fn)


def run_together(core: "EngineCore", seqs: list["Sequence"]) -> list["Sequence"]:
    """Add the sequences to the engine at once and step it until all are done."""
    for seq in seqs:
        core.add(seq)
    while core.has_work:
        core.step()
    return seqs


@pytest.fixture(scope="session")
def prompt():
    """prompt(length, seed) -> random_prompt(length, seed)."""
    return random_prompt
