"""The fp8 DSA latent cache on CUDA (Triton kernels, decode graphs): in float32 it computes what a cache rounding
every vector through e4m3 computes, and in bf16 its logits lose about what bf16 serving loses (the CPU's
yardstick, tests/engine/test_fp8_latent_cache.py). Runs only where a GPU is."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.tiny.factory import write_tiny_model
from tests.engine.conftest import random_prompt
from tests.engine.test_fp8_latent_cache import GREEDY, PROMPTS, kl, rounding_cache  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fp8-cache-cuda"), "bf16", well_conditioned=True)


def cuda_llm(snapshot, kv_cache_dtype: str, dtype: str, **options) -> LLM:
    return LLM(snapshot, device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
               **{"prefix_cache": False, "max_num_batched_tokens": 16, "page_size": 16, **options})


def test_fp8_cache_on_cuda_computes_what_a_rounding_cache_computes(snapshot, rounding_cache):
    fp8 = cuda_llm(snapshot, "fp8", "float32")
    assert fp8.runner.graphs is not None  # decode steps replay their graphs over the fp8 cache
    logits, outputs = fp8.prompt_logits(PROMPTS[0]), [o.token_ids for o in fp8.generate(PROMPTS, GREEDY)]
    rounding_cache()
    plain = cuda_llm(snapshot, "auto", "float32")
    torch.testing.assert_close(logits, plain.prompt_logits(PROMPTS[0]), rtol=1e-4, atol=1e-4)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == outputs


def test_fp8_cache_in_bf16_loses_about_what_bf16_loses(snapshot):
    prompt = random_prompt(300, 7)
    wide = dict(max_num_batched_tokens=2048)
    exact = cuda_llm(snapshot, "auto", "float32", **wide).prompt_logits(prompt)
    bf16 = cuda_llm(snapshot, "auto", "bfloat16", **wide).prompt_logits(prompt).float()
    both = cuda_llm(snapshot, "fp8", "bfloat16", **wide).prompt_logits(prompt).float()
    assert (both - exact).abs().mean() < 2 * (bf16 - exact).abs().mean()  # the two losses add, at most
    assert kl(both, exact) < 3 * kl(bf16, exact)
