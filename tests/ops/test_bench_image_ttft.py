"""ops/bench_image_ttft.py boots glmflash on the tiny model (its small tower) and times a screenshot chat
request against its text alone: the image request's prompt holds the image's tokens, each TTFT is measured."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from engine.tiny.factory import write_tiny_model
from engine.vision.preprocess import ImageProcessorConfig, image_tokens
from ops import bench_image_ttft as bench


def test_screenshots_are_pngs_of_the_size_and_differ_by_seed():
    first, second = bench.screenshot(640, 360, seed=1), bench.screenshot(640, 360, seed=2)
    assert Image.open(io.BytesIO(first)).size == (640, 360) and first != second


def test_boots_the_tiny_model_and_times_both_requests(tmp_path: Path):
    model = write_tiny_model(tmp_path / "tiny", "bf16")
    report = bench.main(["--model", str(model), "--cache-dir", str(tmp_path / "cache"), "--width", "320",
                         "--height", "180", "--rounds", "2", "--max-tokens", "2", "--json", str(tmp_path / "r.json"),
                         "--", "--device", "cpu"])
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["input_modalities"] == ["text", "image"]
    # The image's tokens plus its begin and end markers.
    assert report["image_tokens"] == image_tokens(180, 320, ImageProcessorConfig()) + 2
    assert all(r["text_ttft_ms"] > 0 and r["image_ttft_ms"] > 0 for r in report["rounds"])
