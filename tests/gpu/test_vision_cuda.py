"""Images on CUDA in bf16 against the CPU path in float32 (itself checked against transformers in
tests/engine/vision/): the tower at the release's widths over a 1920x1080 image's grid (the fused attention
kernels at ~10k patches), and whole image prompts through the tiny model. The yardstick is the same
computation in bf16 on the CPU: CUDA may lose at most FACTOR x what it loses. Runs only where a GPU is.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.tiny.factory import write_tiny_model
from ops.bench_vision import image_grid, processor_for, synthetic_tower, vision_config
from tests.engine.test_bf16 import FACTOR, rel_error
from tests.engine.vision.test_image_prompts import processed, text, with_images

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


def test_release_width_tower_on_a_1080p_grid():
    vision = vision_config(depth=2)
    grid = image_grid(1920, 1080, processor_for(vision))
    pixels = torch.randn(grid[1] * grid[2], 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    want = synthetic_tower(vision, torch.float32, cpu, seed=0)(pixels, [grid])
    base = synthetic_tower(vision, torch.bfloat16, cpu, seed=0)(pixels, [grid]).float()
    cuda = torch.device("cuda")
    got = synthetic_tower(vision, torch.bfloat16, cuda, seed=0)(pixels.to(cuda), [grid]).float().cpu()
    assert got.shape == want.shape == (grid[1] * grid[2] // 4, vision.out_hidden_size)
    assert rel_error(got, want) <= FACTOR * rel_error(base, want), (rel_error(got, want), rel_error(base, want))


def test_image_prompt_on_cuda_within_bf16_error(tmp_path):
    snapshot = write_tiny_model(tmp_path / "bf16", "bf16", well_conditioned=True)
    images = [processed(90, 60, seed=1), processed(640, 360, seed=2)]
    prompt = {"prompt_token_ids": with_images(text(20, 1), text(15, 2), text(10, 3)),
              "multi_modal_data": {"image": images}}
    want = LLM(snapshot, "cpu", "float32").prompt_logits(prompt)
    base = LLM(snapshot, "cpu", "bfloat16").prompt_logits(prompt)
    got = LLM(snapshot, "cuda", "bfloat16").prompt_logits(prompt).cpu()
    assert rel_error(got, want) <= FACTOR * rel_error(base, want), (rel_error(got, want), rel_error(base, want))
