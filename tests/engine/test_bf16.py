"""The engine in bf16 against transformers in fp32 (dequantized weights), for every weight format.

bf16 cannot match fp32; it must not lose more than bf16 itself loses. The yardstick is transformers
run in bf16 on the same weights: per decoder layer and on the logits, the engine's distance to the
fp32 reference may exceed the reference's own bf16 distance by at most FACTOR. The model is the
factory's well-conditioned variant, where that distance is small and smooth (the default weights
turn bf16 rounding into different experts and pools, and the errors into noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import FORMATS, Outputs, reference_outputs

PROMPT_LEN = 48  # > index_topk + kpool - 1 = 35: sparse selection drops positions
NEW_TOKENS = 32
# Measured on CPU over 4 formats x 5 prompts: the engine's error is 0.76-1.35x the reference's (it
# mirrors transformers' casts; the spread is bf16 flipping different near-ties); 2x leaves room for
# GPU kernels' own summation order. Rounding an fp32-by-design intermediate (the KDA gate cumsum in
# bf16) gives 2.1-2.7x from layer 0 on; a single extra rounding (norm statistics in bf16) gives ~1.3x,
# inside that spread, so no ratio test on one bf16 run can resolve it.
FACTOR = 2.0
# Agreement moves in steps of 1/NEW_TOKENS and near-ties flip either way (measured: the engine at
# most one token below transformers bf16); 0.1 allows three.
AGREEMENT_MARGIN = 0.1
MIN_REFERENCE_COSINE = 0.999  # what makes the model "well conditioned"


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| over the whole tensor."""
    a, b = ours.double().flatten(), ref.double().flatten()
    return float((a - b).norm() / b.norm())


def errors(run: Outputs, fp32: Outputs) -> list[float]:
    """Relative error against the fp32 reference for each decoder layer, then for the logits."""
    layers = [rel_error(a, b.reshape(a.shape)) for a, b in zip(run.layers, fp32.layers, strict=True)]
    return layers + [rel_error(run.logits, fp32.logits)]


@dataclass(frozen=True)
class Bf16Comparison:
    """Engine bf16 and reference bf16, each against the fp32 reference, on one generated sequence."""

    ours: list[float]  # errors(): per layer, then logits
    base: list[float]
    base_cosine: float  # reference bf16 vs fp32 logits
    ours_agreement: float  # engine's greedy tokens == fp32 argmax on the same history
    base_agreement: float  # reference bf16 argmax == fp32 argmax on the same history

    def table(self) -> str:
        names = [f"layer {i}" for i in range(len(self.ours) - 1)] + ["logits"]
        return "\n".join(f"  {n:8s} engine {o:.2e}  reference {b:.2e}  ratio {o / b:.2f}"
                         for n, o, b in zip(names, self.ours, self.base))

    def first_excess(self, factor: float = FACTOR) -> str | None:
        """The first layer (or the logits) where the engine loses more than `factor` x bf16's own loss."""
        for i, (o, b) in enumerate(zip(self.ours, self.base)):
            if o > factor * b:
                where = "logits" if i == len(self.ours) - 1 else f"layer {i}"
                return f"{where}: engine bf16 error {o:.2e} > {factor} x reference bf16 error {b:.2e}\n{self.table()}"
        return None


def compare_bf16(llm: LLM, fp32_model, bf16_model, prompt_ids: list[int]) -> Bf16Comparison:
    """Generate greedily with the engine, then score every model on prompt + generated tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    generated = llm.generate([prompt_ids], params)[0].token_ids
    ids = prompt_ids + generated
    want, base = reference_outputs(fp32_model, ids), reference_outputs(bf16_model, ids)
    ours = Outputs([t.cpu() for t in llm.layer_outputs(ids)], llm.prompt_logits(ids).cpu())
    rows = slice(len(prompt_ids) - 1, len(ids) - 1)  # the logits that chose each generated token
    target = want.logits[rows].argmax(-1)
    cosine = torch.nn.functional.cosine_similarity(base.logits.double().flatten(), want.logits.double().flatten(),
                                                   dim=0)
    return Bf16Comparison(errors(ours, want), errors(base, want), float(cosine),
                          float((torch.tensor(generated) == target).float().mean()),
                          float((base.logits[rows].argmax(-1) == target).float().mean()))


def assert_within_bf16_error(c: Bf16Comparison, factor: float = FACTOR) -> None:
    assert c.base_cosine >= MIN_REFERENCE_COSINE, f"reference bf16 logits cosine {c.base_cosine:.6f}: ill-conditioned"
    excess = c.first_excess(factor)
    assert excess is None, excess


def assert_greedy_agreement(c: Bf16Comparison) -> None:
    assert c.ours_agreement >= c.base_agreement - AGREEMENT_MARGIN, (
        f"engine bf16 greedy tokens match the fp32 argmax {c.ours_agreement:.0%} of the time, "
        f"transformers bf16 {c.base_agreement:.0%}")


@pytest.fixture(scope="module")
def compared(tiny_dir, reference, prompt):
    """compared(fmt) -> Bf16Comparison, computed once per format."""
    done: dict[str, Bf16Comparison] = {}

    def get(fmt: str) -> Bf16Comparison:
        if fmt not in done:
            snapshot = tiny_dir(fmt, well_conditioned=True)
            done[fmt] = compare_bf16(LLM(snapshot, dtype="bfloat16"), reference(snapshot),
                                     reference(snapshot, torch.bfloat16), prompt(PROMPT_LEN, seed=5))
        return done[fmt]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
def test_layers_and_logits_within_bf16_error(fmt, compared):
    assert_within_bf16_error(compared(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_agree_like_reference_bf16(fmt, compared):
    assert_greedy_agreement(compared(fmt))
