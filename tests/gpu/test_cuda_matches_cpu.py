"""The CUDA path against the CPU reference path, for every weight format (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny.factory import write_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
def test_cuda_equals_cpu(tmp_path, fmt, monkeypatch):
    """The reference ops on CUDA equal the CPU path in fp32 (the fast kernels use TF32 and bf16 tiles:
    tests/gpu/test_bf16_cuda.py and each kernel's own test check them)."""
    monkeypatch.setenv("GLMFLASH_KERNELS", "torch")
    snapshot = write_tiny_model(tmp_path / fmt, fmt)
    ids = torch.randint(0, 283, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu, cuda = LLM(snapshot, "cpu", "float32"), LLM(snapshot, "cuda", "float32")
    want, got = cpu.prompt_logits(ids), cuda.prompt_logits(ids).cpu()
    assert (got - want).abs().max() / want.abs().max() < 1e-4
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [ids[:n] for n in (90, 7, 40)]
    assert [o.token_ids for o in cuda.generate(prompts, params)] == [o.token_ids for o in cpu.generate(prompts, params)]
