"""The fp8 DSA latent cache (`kv_cache_dtype="fp8"`): an engine over it computes what an engine whose cache rounds
every latent and pooled key through e4m3 and back computes (float32, prefill chunks, decode, batches, the prefix
cache's device and host tiers, speculative decoding's restores), it takes about half the bytes a token, and its
logits stay closer to float32's than serving in bf16 does."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache import PagedLatents
from engine.cache.paged_latents import page_parts, scale_groups
from engine.cache.state_rows import page_bytes
from engine.config import ModelConfig
from engine.mtp_drafter import MtpDrafter
from engine.options import EngineOptions
from engine.quant import dequantize_fp8_groups, quantize_fp8_groups
from ops.bench_engine import slice_text_config
from tests.engine.conftest import random_prompt
from tests.engine.test_speculative import forcing_step

PROMPTS = [random_prompt(70, 1), random_prompt(23, 2), random_prompt(41, 3)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def round_trip(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` through e4m3 and back, grouped as the fp8 cache groups them."""
    codes, scales = quantize_fp8_groups(values, values.shape[-1] // scale_groups(values.shape[-1]))
    return dequantize_fp8_groups(codes, scales, dtype)


@pytest.fixture
def rounding_cache(monkeypatch):
    """Within the test, a cache in the activations' dtype stores each written vector rounded through e4m3."""
    def latents(self: PagedLatents, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.latents[layer, rows] = round_trip(values, self.dtype)

    def pool_keys(self: PagedLatents, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.pool_keys[layer, rows] = round_trip(values, self.dtype)

    def install() -> None:
        monkeypatch.setattr(PagedLatents, "write_latents", latents)
        monkeypatch.setattr(PagedLatents, "write_pool_keys", pool_keys)
    return install


def llm(snapshot, kv_cache_dtype: str, dtype: str = "float32", **options) -> LLM:
    return LLM(snapshot, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
               **{"prefix_cache": False, "max_num_batched_tokens": 16, "page_size": 16, **options})


def test_fp8_cache_computes_what_a_cache_rounding_through_fp8_computes(tiny_dir, rounding_cache):
    snapshot = tiny_dir("bf16")
    fp8 = llm(snapshot, "fp8")
    assert fp8.core.cache.latents.dtype == torch.float8_e4m3fn
    logits, outputs = fp8.prompt_logits(PROMPTS[0]), [o.token_ids for o in fp8.generate(PROMPTS, GREEDY)]
    plain = llm(snapshot, "auto")
    unrounded = plain.prompt_logits(PROMPTS[0])
    rounding_cache()
    torch.testing.assert_close(logits, plain.prompt_logits(PROMPTS[0]), rtol=1e-5, atol=1e-5)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == outputs
    assert (logits - unrounded).abs().max() > 1e-3  # the rounding is there to be matched


def test_prefix_hits_over_an_fp8_cache_restore_codes_and_scales(tiny_dir):
    """Conversation turns through the prefix cache answer as the same engine without it (the host tier's copies:
    tests/engine/test_prefix_cache.py, over both caches)."""
    snapshot = tiny_dir("bf16")
    cached, plain = llm(snapshot, "fp8", prefix_cache=True), llm(snapshot, "fp8")
    first = [p + o.token_ids for p, o in zip(PROMPTS, plain.generate(PROMPTS, GREEDY))]
    turns = [t + random_prompt(5, 10 + i) for i, t in enumerate(first)]
    for prompts in (PROMPTS, turns):
        got = [cached.generate([p], GREEDY)[0] for p in prompts]
        assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert cached.core.prefix.stats().hits == 3


def test_speculative_decoding_over_an_fp8_cache_changes_no_token(tiny_dir, monkeypatch):
    """Rejected drafts restore each request's saved page (codes and scales) as in the activations' dtype."""
    snapshot = tiny_dir("bf16", num_nextn_predict_layers=1)
    plain = llm(snapshot, "fp8")
    truth = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain.generate(PROMPTS, GREEDY))}
    monkeypatch.setattr(MtpDrafter, "draft", forcing_step(truth, 0.6, vocab=320))
    speculative = llm(snapshot, "fp8", speculative_tokens=2, measured_draft_length=False)
    assert [o.token_ids for o in speculative.generate(PROMPTS, GREEDY)] == list(truth.values())
    stats = speculative.core.stats().drafts
    assert 0 < stats.verified_accepted < stats.verified


def test_a_token_takes_about_half_the_bytes_at_the_release_shapes():
    """A token of a DSA layer: the 512-wide latent in 512 e4m3 bytes and 4 fp32 scales, and a quarter of its
    pool's key (128 e4m3 bytes and one scale) against 1,024 + 64 bytes in bf16."""
    cfg = ModelConfig.from_dict({"text_config": slice_text_config(4)})
    page = EngineOptions().page_size
    per_token = {fp8: page_bytes(cfg, page, torch.bfloat16, fp8) / page / len(cfg.dsa_layers)
                 for fp8 in (False, True)}
    assert per_token == {False: 1024 + 256 / 4, True: 512 + 4 * 4 + (128 + 4) / 4}
    assert page_parts(cfg, page, torch.bfloat16, True)["latent_scales"][0] == (len(cfg.dsa_layers), page, 4)


def kl(logits: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Mean KL(exact || logits) over positions."""
    return torch.nn.functional.kl_div(logits.float().log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                      reduction="none").sum(-1).mean()


def test_fp8_costs_the_logits_about_what_bf16_serving_costs(tiny_dir):
    """On the well-conditioned model over a 300-token prompt, from float32 with the cache in float32: the fp8
    cache's own loss (float32 activations; measured 0.015-0.018 mean |logit error| over four prompts) below bf16
    activations' (0.019-0.021), its KL within 1.5x of theirs, top-1 agreement within two points."""
    snapshot = tiny_dir("bf16", well_conditioned=True)
    prompt = random_prompt(300, 7)
    exact = llm(snapshot, "auto", max_num_batched_tokens=2048).prompt_logits(prompt)
    fp8 = llm(snapshot, "fp8", max_num_batched_tokens=2048).prompt_logits(prompt)
    bf16 = llm(snapshot, "auto", "bfloat16", max_num_batched_tokens=2048).prompt_logits(prompt).float()
    assert 0 < (fp8 - exact).abs().mean() < (bf16 - exact).abs().mean()
    assert kl(fp8, exact) < 1.5 * kl(bf16, exact)
    agree = {name: (x.argmax(-1) == exact.argmax(-1)).float().mean() for name, x in (("fp8", fp8), ("bf16", bf16))}
    assert agree["fp8"] >= agree["bf16"] - 0.02


def test_kv_cache_dtype_is_auto_or_fp8():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="int8")  # type: ignore[arg-type]
