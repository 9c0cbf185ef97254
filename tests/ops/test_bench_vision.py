"""ops/bench_vision.py on CPU with a tiny tower: it runs and its figures add up, its FLOP count is what the real
forward multiplies, and its grids are the image processor's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from engine.vision.preprocess import ImageProcessorConfig, preprocess
from ops import bench_vision as bench

TINY = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 48,
        "projection_intermediate_size": 80}


def test_tiny_run_reports_every_case(tmp_path, capsys):
    out = tmp_path / "vision.json"
    result = bench.main(["--device", "cpu", "--dtype", "float32", "--depth", "1", "--hidden", "32", "--heads", "2",
                         "--intermediate", "64", "--out-hidden", "48", "--projection-intermediate", "80",
                         "--sizes", "56x84", "--batches", "1,2", "--iters", "1", "--warmup", "0",
                         "--peak-size", "128", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    vision = bench.vision_config(**TINY)
    grid = bench.image_grid(56, 84, bench.processor_for(vision))
    assert grid == (1, 10, 8)  # 3 x 2 merged patches scaled up to the 16-token minimum: 5 x 4
    assert result["weight_bytes"] == 4 * sum(t.numel() for t in bench.synthetic_tower(
        vision, torch.float32, torch.device("cpu"), 0).w.values())
    assert [(c["batch"], c["patches"], c["tokens"]) for c in result["cases"]] == [(1, 80, 20), (2, 160, 40)]
    for case in result["cases"]:
        flops = bench.tower_flops(vision, [grid] * case["batch"])
        assert case["gflop"] == pytest.approx(flops / 1e9)
        assert case["ms"] > 0 and case["ms_per_image"] == pytest.approx(case["ms"] / case["batch"])
        assert case["roofline_ms"] == pytest.approx(flops / (result["peak_tflops"] * 1e12) * 1e3)
        assert case["ratio"] == pytest.approx(case["roofline_ms"] / case["ms"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("event=vision_tower")]
    assert len(lines) == 2 and "size=56x84 batch=2 attention=default grid=1x10x8 patches=160 tokens=40 " in lines[1]


def test_flop_count_matches_the_forwards_matmuls(monkeypatch):
    """Count 2*M*N*K over every linear and 4*L*S*head_dim*heads over every attention call of a real forward,
    images of different sizes packed, so a term left out or a wrong attention length fails."""
    vision = bench.vision_config(**{**TINY, "depth": 2})
    tower = bench.synthetic_tower(vision, torch.float32, torch.device("cpu"), 0)
    counted = [0]
    linear, attention = F.linear, F.scaled_dot_product_attention

    def counting_linear(x, weight, bias=None):
        counted[0] += 2 * x[..., 0].numel() * weight.shape[0] * weight.shape[1]
        return linear(x, weight, bias)

    def counting_attention(q, k, v, *args, **kwargs):
        rows = q[..., 0].numel() * k.shape[-2]  # heads x queries x keys
        counted[0] += 2 * rows * q.shape[-1] + 2 * rows * v.shape[-1]  # QK^T, then PV
        return attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "linear", counting_linear)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_attention)
    grids = [(1, 10, 8), (1, 4, 6), (2, 4, 4)]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    out = tower(pixels, grids)
    assert out.shape == (pixels.shape[0] // 4, vision.out_hidden_size)
    assert counted[0] == bench.tower_flops(vision, grids)


def test_1920x1080_grid_is_the_processors():
    processor = ImageProcessorConfig()
    image = Image.new("RGB", (1920, 1080), (90, 120, 200))
    grid = bench.image_grid(*bench.parse_size("1920x1080"), bench.processor_for(bench.vision_config()))
    assert grid == preprocess(image, processor).grid_thw == (1, 78, 138)
