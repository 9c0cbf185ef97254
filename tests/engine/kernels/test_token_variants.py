"""The start's warm-up lengths take every build a step's token count can pick (engine/kernels/token_variants.py),
and the launchers pick the builds they say they do."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import token_variants
from engine.kernels.experts import prefill
from engine.kernels.kda import triton_spans
from engine.kernels.linear import triton_linear
from engine.kernels.token_variants import covering_lengths, variant_key
from engine.quant import quantize_fp8_block
from engine.weights import Fp8BlockWeight


def test_covering_lengths_take_each_combination_once_the_longest_first(monkeypatch):
    bands = [lambda t: t <= 16, lambda t: min(t // 100, 3), lambda t: t > 250]  # combinations cut at 17, 100, ...
    monkeypatch.setattr(token_variants, "_VARIANTS", bands)
    lengths = covering_lengths(400, done=[400])
    assert lengths == sorted(lengths, reverse=True) and 400 not in lengths
    taken = [variant_key(t) for t in [400, *lengths]]
    assert len(set(taken)) == len(taken)  # one length per combination
    assert {variant_key(t) for t in range(1, 401)} == set(taken)  # every count's builds among them
    assert covering_lengths(400, done=range(1, 401)) == []


def test_the_fp8_linear_launches_the_builds_its_pick_names(monkeypatch):
    """Every token count's launch (tile, K split, warps, stages) is the one `_builds` names for it, and the
    counts the warm-up would prefill launch every distinct build that any count does."""
    launched: dict[int, tuple] = {}

    class Recorder:  # stands in for the kernel: what each launch asked for
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launched[args[5]] = (meta["A_FP8"], meta["BM"], meta["BN"], meta["num_warps"], meta["num_stages"],
                                     meta["K_SPLIT"])
            return launch

    monkeypatch.setattr(triton_linear, "_fp8_linear_kernel", Recorder())
    monkeypatch.setattr(triton_linear, "_SHAPES_RUN", set())
    monkeypatch.setattr(token_variants, "_VARIANTS", [triton_linear._builds])
    data, scale = quantize_fp8_block(torch.randn(128, 512))
    weight = Fp8BlockWeight(data, scale)
    for tokens in range(1, 201):
        triton_linear.fp8_block_linear(torch.randn(tokens, 512), weight)
    for tokens, launch in launched.items():
        assert triton_linear._builds(tokens) == (launch,)
    assert len(set(launched.values())) == 3  # decode tile, K split four ways, no split (2 then 4 tiles on 4 SMs)
    warmed = [200, *covering_lengths(200, done=[200])]
    assert {launched[t] for t in warmed} == set(launched.values())


@pytest.mark.parametrize("experts,rows", [(288, [16, 32, 64]), (38, [16, 32, 64, 128])])
def test_the_expert_tile_each_count_takes_is_one_the_warm_up_takes(monkeypatch, experts, rows):
    monkeypatch.setattr(prefill, "_LAYERS_RUN", {(8, experts, prefill.PrefillTiles(), False)})
    monkeypatch.setattr(token_variants, "_VARIANTS", [prefill._builds])
    warmed = [2048, *covering_lengths(2048, done=[2048])]
    heights = {t: prefill._builds(t)[0][0] for t in range(1, 2049)}
    assert sorted({heights[t] for t in warmed}) == sorted(set(heights.values())) == rows
    assert len(warmed) == len(rows)


def test_a_short_prefill_warms_the_kda_recurrence_and_a_long_one_the_chunked_path(monkeypatch):
    monkeypatch.setattr(triton_spans, "_SHAPES_RUN", {(64, 128)})
    monkeypatch.setattr(token_variants, "_VARIANTS", [triton_spans._builds])
    assert covering_lengths(2048, done=[2048]) == [triton_spans.SHORT_SPAN_TOKENS]
    monkeypatch.setattr(triton_spans, "_SHAPES_RUN", set())  # a model without KDA layers: nothing to add
    assert covering_lengths(2048, done=[2048]) == []
