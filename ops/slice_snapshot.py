"""A full-width slice of GLM-5.3-Flash written as a safetensors snapshot of about a given size (load benchmarks).

Every tensor has the release's full width (hidden 4096, vocabulary 154,880, 2048-wide experts) and
is stored the way the chosen release stores it; the size decides how many MoE layers the slice has
and, below one full layer, how many routed experts a layer has (`--layers` fixes the depth instead, and
the size the experts per layer). Values are random; one random matrix
per layer and projection is quantized and then stored once per expert, so writing hundreds of GB
does not mean quantizing hundreds of GB. Config, generation config and the tiny model's tokenizer
are written beside the shards, so `glmflash boot --model DIR` serves it; the output head keeps random
rows only for the tokenizer's printable ASCII bytes (see `text_only_head`), so a served slice writes text.

    python -m ops.slice_snapshot /workspace/slice-20g --gib 20 [--format nvfp4-ct] [--shard-gib 4] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint.layout import EXPERT_KEY, TensorSpec, quantized_in_release, text_specs, vision_specs
from engine.config import ModelConfig
from engine.tiny.factory import IMAGE_TOKEN_IDS, encode, init_value, tiny_config, vision_value
from engine.tiny.tokenizer import write_tokenizer
from ops.bench_engine import slice_text_config

FULL_EXPERTS = 288
MIN_EXPERTS = 8  # the release's top-k
TEXT_IDS = slice(0x20, 0x7F)  # printable ASCII: the byte-level tokenizer's id of a byte is the byte


def stored_bytes(spec: TensorSpec, fmt: str, cfg: ModelConfig) -> int:
    """Bytes one layout entry takes in the release format (for sizing the slice before writing it)."""
    count = math.prod(spec.shape)
    if spec.role == "fp32":
        return 4 * count
    if not quantized_in_release(cfg, spec):
        return 2 * count
    n, k = spec.shape
    if fmt == "fp8":
        return count + 4 * math.ceil(n / 128) * math.ceil(k / 128)
    return count // 2 + count // 16 + 4


def text_only_head(value: torch.Tensor) -> torch.Tensor:
    """lm_head with every row zeroed but the printable ASCII bytes': those logits stay random, all others are 0,
    so greedy decoding picks text (the vocabulary has 154,880 ids, the tokenizer 283: the others decode to
    nothing, and a serving benchmark times text). Same bytes and the same work as a fully random head."""
    head = torch.zeros_like(value)
    head[TEXT_IDS] = value[TEXT_IDS]
    return head


def slice_config(fmt: str, layers: int, experts: int, vision: bool = False) -> dict:
    """config.json: the release's text config cut to `layers` MoE layers of `experts` routed experts; with
    `vision`, the release's vision tower (its image tokens the tiny tokenizer's)."""
    text = {**slice_text_config(layers), "model_type": "glm5_next_text", "n_routed_experts": experts}
    config = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text}
    if vision:
        config.update(vision_config={"model_type": "glm5_next_vision"}, **IMAGE_TOKEN_IDS)
    quantization = tiny_config(fmt).get("quantization_config")
    return {**config, "quantization_config": quantization} if quantization else config


def plan_slice(target_bytes: int, fmt: str, layers: int | None = None) -> tuple[int, int]:
    """(MoE layers, routed experts per layer) whose snapshot comes closest to `target_bytes` from below
    (at least one layer of MIN_EXPERTS experts). `layers` fixes the depth and sizes the experts to fit: a
    deeper slice with fewer experts keeps a prefill's per-layer work (tokens x top-k, whatever the expert
    count) and the layers' 3:1 KDA:DSA mix, where a shallow one of full layers has neither."""
    def size(depth: int, experts: int) -> int:
        cfg = ModelConfig.from_dict(slice_config(fmt, depth, experts))
        return sum(stored_bytes(s, fmt, cfg) for s in text_specs(cfg))

    if layers is None:
        per_layer = size(2, FULL_EXPERTS) - size(1, FULL_EXPERTS)
        if target_bytes >= size(1, FULL_EXPERTS):
            return max(1, 1 + (target_bytes - size(1, FULL_EXPERTS)) // per_layer), FULL_EXPERTS
        layers = 1
    least = size(layers, MIN_EXPERTS)
    per_expert = (size(layers, FULL_EXPERTS) - least) / (FULL_EXPERTS - MIN_EXPERTS)
    return layers, min(FULL_EXPERTS, max(MIN_EXPERTS, MIN_EXPERTS + int((target_bytes - least) // per_expert)))


def write_slice_snapshot(out_dir: Path, gib: float, fmt: str = "nvfp4-ct", shard_gib: float = 4.0,
                         seed: int = 0, layers: int | None = None, vision: bool = False) -> tuple[Path, int]:
    """Write the slice into out_dir; returns (out_dir, bytes of its shards). `vision` adds the release's tower
    (1.1 GB in BF16) beyond `gib`, which sizes the text model."""
    layers, experts = plan_slice(int(gib * 2**30), fmt, layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(out)
    config = slice_config(fmt, layers, experts, vision)
    config["text_config"].update(eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": tok.eos_token_ids, "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    cfg = ModelConfig.from_dict(config, generation)
    generator = torch.Generator().manual_seed(seed)
    shard_bytes = int(shard_gib * 2**30)
    shard: dict[str, torch.Tensor] = {}
    names: list[str] = []
    weight_map: dict[str, str] = {}
    size = total = 0
    shared: dict[tuple[str, str], tuple[str, dict[str, torch.Tensor]]] = {}
    for spec in [*text_specs(cfg), *vision_specs(cfg)]:
        expert = EXPERT_KEY.match(spec.name)
        if expert:  # one quantized matrix per layer and projection, a copy of it per expert
            slot = (expert.group(1), expert.group(3))
            if slot not in shared:
                shared[slot] = (spec.name, encode(spec, init_value(spec, generator), fmt, cfg))
            first, entries = shared[slot]
            entries = {key.replace(first, spec.name): t.clone() for key, t in entries.items()}
        else:
            value = vision_value(spec, generator) if spec.name.startswith("visual.") else init_value(spec, generator)
            entries = encode(spec, text_only_head(value) if spec.name == "lm_head" else value, fmt, cfg)
        nbytes = sum(t.numel() * t.element_size() for t in entries.values())
        if shard and size + nbytes > shard_bytes:
            names.append(_save(shard, out, len(names)))
            shard, size = {}, 0
        shard.update(entries)
        weight_map.update({key: _shard_name(len(names)) for key in entries})
        size += nbytes
        total += nbytes
    names.append(_save(shard, out, len(names)))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out, total


def _shard_name(index: int) -> str:
    return f"model-{index + 1:05d}.safetensors"


def _save(shard: dict[str, torch.Tensor], out: Path, index: int) -> str:
    save_file(shard, str(out / _shard_name(index)), metadata={"format": "pt"})
    return _shard_name(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gib", type=float, required=True, help="snapshot size to aim for (weights), in GiB")
    parser.add_argument("--format", default="nvfp4-ct", choices=["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
    parser.add_argument("--shard-gib", type=float, default=4.0)
    parser.add_argument("--layers", type=int, help="MoE layers (default: full layers of 288 experts as the size "
                        "allows); with it, the routed experts per layer are what the size allows")
    parser.add_argument("--vision", action="store_true", help="with the release's vision tower (image requests)")
    args = parser.parse_args()
    out, total = write_slice_snapshot(args.out_dir, args.gib, args.format, args.shard_gib, layers=args.layers,
                                      vision=args.vision)
    cfg = ModelConfig.from_dir(out)
    print(f"snapshot={out} bytes={total} layers={cfg.num_layers} experts={cfg.n_routed_experts} "
          f"format={args.format}", flush=True)


if __name__ == "__main__":
    main()
