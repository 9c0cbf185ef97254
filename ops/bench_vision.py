"""Vision tower speed: one forward over a batch of images, at the release's shapes, against the matmul roofline.

The tower (24 blocks of width 1024, 16 heads, SwiGLU 4096; merger to 4096 through 10240) is built from the
checkpoint layout with random weights in the serving dtype on the device. Each case is `batch` images of one
size, each fitted to its canvas by the image processor's rule (1920x1080 -> 1932x1092, 69 x 39 merged
patches) and packed into one call, as the engine packs a step's new images. The time is the median of
--iters calls after --warmup (CUDA events on a GPU). The roofline is the forward's matmul FLOPs (linears, and
attention per image, quadratic in its patches) over a dense square matmul's rate measured in the same run, in
the same dtype; `ratio` is roofline over measured, i.e. the fraction of that peak the tower reaches.

    python ops/bench_vision.py --json vision.json                 # CUDA, bf16, 448x448 and 1920x1080, batch 1 and 8
    python ops/bench_vision.py --device cpu --depth 1 --sizes 448x448 --batches 1 --iters 1 --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.checkpoint.layout import vision_specs
from engine.config import ModelConfig, VisionConfig
from engine.model.vision import VisionTower, vision_weights
from engine.tiny.factory import tiny_config, vision_value
from engine.vision.preprocess import ImageProcessorConfig, canvas_size

# --attention: torch's own choice of scaled_dot_product_attention kernel, or one forced.
ATTENTION = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
RELEASE_TEXT_HIDDEN = 4096  # the text model's width, which the merger projects to
OVERRIDES = {"depth": "depth", "hidden": "hidden_size", "heads": "num_heads", "intermediate": "intermediate_size",
             "out_hidden": "out_hidden_size", "projection_intermediate": "projection_intermediate_size"}


def vision_config(**overrides: int | None) -> VisionConfig:
    """The release's tower (a `vision_config` that states no sizes takes the release's), with the given fields
    replaced; None keeps the release's value."""
    release = VisionConfig.from_dict({"model_type": "glm5_next_vision"}, RELEASE_TEXT_HIDDEN)
    vision = dataclasses.replace(release, **{k: v for k, v in overrides.items() if v is not None})
    if vision.hidden_size % vision.num_heads or vision.head_dim % 4:  # the rotary splits each head in quarters
        raise ValueError(f"hidden_size={vision.hidden_size} over num_heads={vision.num_heads} must give heads of "
                         "a multiple of 4")
    return vision


def synthetic_tower(vision: VisionConfig, dtype: torch.dtype, device: torch.device, seed: int) -> VisionTower:
    """The tower over random tensors of the layout's names and shapes (`vision_specs` reads only the config's
    tower, so the tiny text model carries it)."""
    carrier = dataclasses.replace(ModelConfig.from_dict(tiny_config()), vision=vision)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {spec.name: vision_value(spec, generator).to(dtype) for spec in vision_specs(carrier)}
    return VisionTower(vision, vision_weights(tensors))


def processor_for(vision: VisionConfig) -> ImageProcessorConfig:
    """The default image processor, cutting patches the tower's way."""
    return ImageProcessorConfig(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                merge_size=vision.spatial_merge_size)


def parse_size(text: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height)."""
    width, height = text.lower().split("x")
    return int(width), int(height)


def image_grid(width: int, height: int, processor: ImageProcessorConfig) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches for a still image of this size: its canvas cut into patches."""
    canvas_h, canvas_w = canvas_size(height, width, processor)
    return 1, canvas_h // processor.patch_size, canvas_w // processor.patch_size


def tower_flops(vision: VisionConfig, grids: list[tuple[int, int, int]]) -> int:
    """Matmul FLOPs of one forward over these images (2 per multiply-add). Norms, rotary and activations are
    left out: a few FLOPs per element against the linears' thousands."""
    d, merge = vision.hidden_size, vision.spatial_merge_size
    lengths = [t * h * w for t, h, w in grids]
    patches, merged = sum(lengths), sum(lengths) // merge ** 2
    patch_in = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    embed = 2 * patches * patch_in * d
    linears = 2 * patches * d * (3 * d + d + 3 * vision.intermediate_size)  # qkv, proj, gate/up/down
    attention = 4 * d * sum(n * n for n in lengths)  # QK^T and PV over every head, within each image
    out = vision.out_hidden_size
    merger = 2 * merged * out * (d * merge ** 2 + out + 3 * vision.projection_intermediate_size)
    return embed + vision.depth * (linears + attention) + merger


def median_ms(call: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median ms of `iters` calls after `warmup` ones: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            call()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, warmup: int, iters: int) -> float:
    """Measured FLOP/s of an n x n x n matmul: the dense rate the roofline divides by."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / (median_ms(lambda: a @ b, device, warmup, iters) / 1e3)


def packed_images(grid: tuple[int, int, int], batch: int, vision: VisionConfig, device: torch.device,
                  generator: torch.Generator) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Random float32 pixel_values of `batch` images of one grid, packed as the engine passes them."""
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    patches = batch * grid[0] * grid[1] * grid[2]
    return torch.randn(patches, width, generator=generator, device=device), [grid] * batch


def attention_kernel(name: str, call: Callable[[], Any]) -> Any:
    """`call()` with scaled_dot_product_attention held to the named kernel (torch's choice for "default")."""
    if ATTENTION[name] is None:
        return call()
    with sdpa_kernel(ATTENTION[name]):
        return call()


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, str) and " " in value else str(value)


def kv_line(event: str, fields: dict[str, Any]) -> str:
    return " ".join([f"event={event}"] + [f"{k}={fmt(v)}" for k, v in fields.items()])


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vision = vision_config(**{field: getattr(args, arg) for arg, field in OVERRIDES.items()})
    tower = synthetic_tower(vision, dtype, device, args.seed)
    processor = processor_for(vision)
    weight_bytes = sum(t.numel() * t.element_size() for t in tower.w.values())
    peak_size = args.peak_size or (8192 if device.type == "cuda" else 2048)
    with torch.inference_mode():
        peak = matmul_peak(device, dtype, peak_size, max(args.warmup, 1), max(args.iters, 3))
        setup = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "dtype": args.dtype, "depth": vision.depth, "hidden": vision.hidden_size, "heads": vision.num_heads,
                 "intermediate": vision.intermediate_size, "out_hidden": vision.out_hidden_size,
                 "projection_intermediate": vision.projection_intermediate_size, "weight_bytes": weight_bytes,
                 "weight_gb": weight_bytes / 1e9, "peak_size": peak_size, "peak_tflops": peak / 1e12}
        print(kv_line("vision_setup", setup), flush=True)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        cases = []
        for size in args.sizes:
            grid = image_grid(*parse_size(size), processor)
            for batch in args.batches:
                pixels, grids = packed_images(grid, batch, vision, device, generator)
                ms = median_ms(lambda: attention_kernel(args.attention, lambda: tower(pixels, grids)), device,
                               args.warmup, args.iters)
                flops = tower_flops(vision, grids)
                roofline_ms = flops / peak * 1e3
                case = {"size": size, "batch": batch, "attention": args.attention, "grid": "x".join(map(str, grid)), "patches": pixels.shape[0],
                        "tokens": pixels.shape[0] // vision.spatial_merge_size ** 2, "ms": ms,
                        "ms_per_image": ms / batch, "gflop": flops / 1e9, "tflops": flops / ms / 1e9,
                        "roofline_ms": roofline_ms, "ratio": roofline_ms / ms}
                print(kv_line("vision_tower", case), flush=True)
                cases.append(case)
    return {**setup, "config": dataclasses.asdict(vision), "iters": args.iters, "warmup": args.warmup,
            "cases": cases}


def _list(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="default", choices=list(ATTENTION),
                        help="the attention kernel (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sizes", type=_list, default="448x448,1920x1080", help="comma-separated WIDTHxHEIGHT")
    parser.add_argument("--batches", type=lambda t: [int(b) for b in _list(t)], default="1,8",
                        help="comma-separated images per call")
    for arg, field in OVERRIDES.items():
        parser.add_argument("--" + arg.replace("_", "-"), type=int, help=f"tower {field} (default: the release's)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per case (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    parser.add_argument("--peak-size", type=int, help="side of the square matmul timed for the peak "
                                                      "(default 8192 on CUDA, 2048 on the CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
