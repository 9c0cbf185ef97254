"""The compiled-kernel manifest on CUDA: a first start records the Triton specializations it compiles; a
second process, with an empty Triton cache, preloads them while it loads and then compiles nothing more
for the same work, with the same tokens (runs only where a GPU is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.child_env import child_env
from engine.tiny.factory import write_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

CHILD = """
import json, sys
from pathlib import Path
from engine import LLM, SamplingParams
from engine.kernels.kernel_manifest import COMPILES

llm = LLM(sys.argv[1], "cuda", "bfloat16", max_model_len=256, kernels_file=Path(sys.argv[2]))
at_ready, compiled = COMPILES.count, dict(COMPILES.by_kernel)
prompts = [[5, 9, 13, 200, 7] * k for k in json.loads(sys.argv[3])]
out = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
late = sorted(name for name in COMPILES.by_kernel if COMPILES.by_kernel[name] != compiled.get(name))
print(json.dumps({"at_ready": at_ready, "total": COMPILES.count, "tokens": [o.token_ids for o in out], "late": late}))
"""


def start(snapshot: Path, manifest: Path, triton_cache: Path, repeats: tuple[int, ...] = (1, 6, 20)) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(snapshot), str(manifest), json.dumps(repeats)],
                          env=child_env(TRITON_CACHE_DIR=str(triton_cache)), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_preloads_what_the_first_compiled(tmp_path):
    snapshot = write_tiny_model(tmp_path / "tiny", "nvfp4-ct")
    manifest = tmp_path / "kernels.json"
    first = start(snapshot, manifest, tmp_path / "triton-first")
    kept = json.loads(manifest.read_text())["kernels"]
    assert first["total"] > 0 and len(kept) > 0
    second = start(snapshot, manifest, tmp_path / "triton-second")  # an empty cache: every preload compiles
    assert second["tokens"] == first["tokens"]
    # Child processes compiled the manifest for the architecture; the process read those binaries back (the
    # same cache keys) instead of compiling its own: one binary per specialization, not two.
    binaries = list((tmp_path / "triton-second").rglob("*.cubin"))
    assert len(binaries) <= len(kept) + 5, (len(binaries), len(kept))
    assert second["total"] - second["at_ready"] == 0, "requests compiled kernels the preload should have"
    assert second["at_ready"] <= len(kept) + 5  # the preload's compiles, and little besides


@pytest.mark.parametrize("fmt", ["nvfp4-ct", "fp8"])
def test_a_first_start_leaves_no_compile_to_steps_of_any_length(tmp_path, fmt):
    """No manifest, an empty Triton cache: the start's warm-up builds every variant a step's token count can
    pick (engine/kernels/token_variants.py: the expert tiles' heights, the FP8 linears' K splits; mHC builds
    one per token tile), so prompts of assorted lengths, batched into steps of assorted sizes, compile
    nothing after the start."""
    snapshot = write_tiny_model(tmp_path / "tiny", fmt)
    first = start(snapshot, tmp_path / "kernels.json", tmp_path / "triton", repeats=(1, 4, 11, 19, 29, 40))
    assert first["total"] - first["at_ready"] == 0, f"compiled while serving: {first['late']}"


def test_a_start_seeded_with_prebuilt_kernels_compiles_none_of_them(tmp_path):
    """An image's build compiles a manifest offline (`python -m engine.kernels.prebuilt`); a start on a fresh
    volume seeded from it reads those binaries and compiles nothing of them, with the same tokens."""
    from engine.kernels.prebuilt import seed

    snapshot = write_tiny_model(tmp_path / "tiny", "nvfp4-ct")
    recorded = tmp_path / "kernels.json"
    first = start(snapshot, recorded, tmp_path / "triton-first")
    prebuilt = tmp_path / "prebuilt"
    done = subprocess.run([sys.executable, "-m", "engine.kernels.prebuilt", str(prebuilt), "--manifest", str(recorded)],
                          env=child_env("TRITON_CACHE_DIR"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    built = sorted(p.name for p in (prebuilt / "triton").rglob("*.cubin"))
    assert built and "left_out=0" in done.stdout
    volume = tmp_path / "triton-volume"
    assert seed(prebuilt, volume) > 0
    seeded = start(snapshot, tmp_path / "fresh-volume-kernels.json", volume)
    assert seeded["tokens"] == first["tokens"]
    assert seeded["total"] - seeded["at_ready"] == 0
    assert sorted(p.name for p in volume.rglob("*.cubin")) == built  # every binary read, none compiled anew
