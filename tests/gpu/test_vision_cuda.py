"""Images on CUDA in bf16 against the CPU path in float32 (itself checked against transformers in
tests/engine/vision/): the tower at the release's widths over a 448x448 and a 1920x1080 image's grid (the
fused attention kernels at ~10k patches) within bf16's rounding, and whole image prompts through the tiny
model, where the yardstick is the same prompt in bf16 on the CPU (CUDA may lose at most FACTOR x what it
loses). Runs only where a GPU is.
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


# CUDA's bf16 tower against the CPU's float32, measured against the CPU's own bf16 loss on the 448x448 grid
# (1.3e-2 at depth 2 with the synthetic weights): flash attention rounds its probabilities to bf16 where the
# CPU keeps them in float32, so up to TOWER_FACTOR x that; a wrong rotary, patch order or an attention split
# across images is O(1).
TOWER_FACTOR = 4.0


def tower_error(size: tuple[int, int], dtype: torch.dtype, device: str) -> float:
    vision = vision_config(depth=2)
    grid = image_grid(*size, processor_for(vision))
    pixels = torch.randn(grid[1] * grid[2], 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    want = synthetic_tower(vision, torch.float32, torch.device("cpu"), seed=0)(pixels, [grid])
    got = synthetic_tower(vision, dtype, torch.device(device), seed=0)(pixels.to(device), [grid]).float().cpu()
    assert got.shape == want.shape == (grid[1] * grid[2] // 4, vision.out_hidden_size)
    return rel_error(got, want)


@pytest.mark.parametrize("size", [(448, 448), (1920, 1080)])
def test_release_width_tower(size):
    base, error = tower_error((448, 448), torch.bfloat16, "cpu"), tower_error(size, torch.bfloat16, "cuda")
    print(f"event=tower_cuda_bf16 size={size[0]}x{size[1]} rel_error={error:.2e} cpu_bf16_448={base:.2e}")
    assert error <= TOWER_FACTOR * base


def test_image_prompt_on_cuda_within_bf16_error(tmp_path):
    snapshot = write_tiny_model(tmp_path / "bf16", "bf16", well_conditioned=True)
    images = [processed(90, 60, seed=1), processed(640, 360, seed=2)]
    prompt = {"prompt_token_ids": with_images(text(20, 1), text(15, 2), text(10, 3)),
              "multi_modal_data": {"image": images}}
    want = LLM(snapshot, "cpu", "float32").prompt_logits(prompt)
    base = LLM(snapshot, "cpu", "bfloat16").prompt_logits(prompt)
    got = LLM(snapshot, "cuda", "bfloat16").prompt_logits(prompt).cpu()
    assert rel_error(got, want) <= FACTOR * rel_error(base, want), (rel_error(got, want), rel_error(base, want))
