"""The prefill chunk the memory plan chooses under hybrid offload where the options leave it open: the shortest
multiple of the decode steps' budget whose math covers the host experts' copy, within the memory it may take;
and the engine that takes it (its steps of prompts alone, its warm-up, the same tokens out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.loading
from engine import LLM, SamplingParams
from engine.checkpoint.loader import checkpoint_sizes
from engine.engine_core import EngineCore
from engine.loading import load_checkpoint
from engine.config import ModelConfig
from engine.memory_plan import BASE_RESERVE, WeightBytes, plan_memory, reserve_bytes
from engine.options import EngineOptions
from engine.sequence import Sequence
from engine.prefill_chunk import (MOST_RESERVE_SHARE, PREFILL_OVER_EXPERT_MATMUL, PrefillRates, chunk_tokens,
                                  measured_prefill_rates, most_chunk_tokens, token_seconds)

from tests.engine.conftest import run_together

CPU = torch.device("cpu")
STEP = 128
SIZES = EngineOptions(max_num_seqs=2, max_model_len=1024, max_num_batched_tokens=STEP, prefix_cache=False)
PER_EXPERT = 50


@pytest.fixture(scope="module")
def config(tiny_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir("nvfp4-ct"))


def test_the_chunk_is_the_shortest_multiple_of_the_step_whose_math_covers_the_link():
    assert chunk_tokens(STEP, link_seconds=1.0, seconds_a_token=1 / 300, most=1024) == 384  # 300 tokens: 3 steps
    assert chunk_tokens(STEP, link_seconds=1.0, seconds_a_token=1 / 256, most=1024) == 256  # exactly two
    assert chunk_tokens(STEP, link_seconds=1e-9, seconds_a_token=1.0, most=1024) == STEP  # never under a step
    assert chunk_tokens(STEP, link_seconds=1.0, seconds_a_token=1e-6, most=512) == 512  # memory's cap


def test_the_longest_chunk_takes_a_share_of_the_expert_budget_at_most():
    token = 1 << 20
    budget = int(64 * STEP * token / MOST_RESERVE_SHARE)  # 64 steps' tokens of reserve in the share
    assert most_chunk_tokens(STEP, budget, token, max_model_len=1 << 20) == 65 * STEP
    assert most_chunk_tokens(STEP, budget - 1, token, max_model_len=1 << 20) == 64 * STEP  # whole steps only
    assert most_chunk_tokens(STEP, budget, token, max_model_len=1000) == 7 * STEP  # no longer than a prompt can be
    assert most_chunk_tokens(STEP, 0, token, max_model_len=1 << 20) == STEP


def test_a_tokens_math_follows_its_routed_experts_flops(config):
    rates = PrefillRates(link=1e9, matmul=1e12)
    flops = 6 * config.hidden_size * config.moe_intermediate_size * config.num_experts_per_tok
    assert token_seconds(config, rates) == pytest.approx(PREFILL_OVER_EXPERT_MATMUL * flops / 1e12)
    assert token_seconds(config, dataclasses.replace(rates, matmul=2e12)) == pytest.approx(
        token_seconds(config, rates) / 2)


def hybrid_plan(config: ModelConfig, rates: PrefillRates | None, slots: int = 3, **options):
    """The plan with `slots` device slots a layer of experts of PER_EXPERT bytes (an explicit budget)."""
    layers = len(config.moe_layers)
    experts = PER_EXPERT * layers * config.n_routed_experts
    sizes = dataclasses.replace(SIZES, moe_vram_budget=slots * layers * PER_EXPERT, **options)
    return plan_memory(config, sizes, CPU, torch.float32, WeightBytes(1000 + experts, experts, layers), 64 << 30,
                       measure_rates=lambda: rates)


def link_for(config: ModelConfig, tokens: float, slots: int = 3) -> PrefillRates:
    """Rates at which the host bank's copy (n - slots experts a layer) takes `tokens` tokens' math."""
    matmul = 1e12
    seconds = token_seconds(config, PrefillRates(1.0, matmul)) * tokens
    return PrefillRates(link=(config.n_routed_experts - slots) * PER_EXPERT / seconds, matmul=matmul)


def test_the_plan_chooses_the_chunk_and_reserves_for_it(config):
    """Where experts stay in host RAM: the chunk from the rates, the reserve sized for it, the budget (explicit)
    unchanged; a link that the decode step's math already covers leaves the step as it is."""
    plain = hybrid_plan(config, None)
    assert plain.prefill_tokens is None and plain.reserve_bytes == reserve_bytes(STEP, SIZES.max_model_len)
    slow_link = hybrid_plan(config, link_for(config, 2.5 * STEP))
    assert slow_link.prefill_tokens == 3 * STEP
    assert slow_link.reserve_bytes == reserve_bytes(3 * STEP, SIZES.max_model_len)
    assert (slow_link.expert_budget, slow_link.expert_slots) == (plain.expert_budget, plain.expert_slots)
    assert hybrid_plan(config, link_for(config, 0.5 * STEP)).prefill_tokens == STEP
    assert hybrid_plan(config, link_for(config, 100 * STEP)).prefill_tokens == SIZES.max_model_len  # 8 steps


def test_the_options_chunk_and_an_all_resident_model_are_left_alone(config):
    rates = link_for(config, 2.5 * STEP)
    assert hybrid_plan(config, rates, max_prefill_tokens=200).prefill_tokens == 200
    assert hybrid_plan(config, rates, slots=config.n_routed_experts).prefill_tokens is None  # nothing crosses


def test_the_auto_budget_gives_the_longer_chunks_reserve(config):
    """Under an automatic budget the chunk's reserve comes out of the experts' memory: fewer slots, within the
    share the chunk may take."""
    layers = len(config.moe_layers)
    experts = (64 << 20) * layers * config.n_routed_experts  # 64 MiB an expert
    weights = WeightBytes(1000 + experts, experts, layers)
    sizes = dataclasses.replace(SIZES, moe_vram_budget="auto")
    free = 1000 + reserve_bytes(STEP, SIZES.max_model_len) + (6 << 30)  # ~6 GiB for experts and the caches
    plain = plan_memory(config, sizes, CPU, torch.float32, weights, free)
    assert 0 < plain.expert_slots < config.n_routed_experts
    rates = PrefillRates(link=1e-3, matmul=1e12)  # a link so slow that memory alone bounds the chunk
    chosen = plan_memory(config, sizes, CPU, torch.float32, weights, free, lambda: rates)
    most = most_chunk_tokens(STEP, plain.expert_budget, reserve_bytes(1, SIZES.max_model_len) - BASE_RESERVE,
                             SIZES.max_model_len)
    assert chosen.prefill_tokens == most == 2 * STEP  # 6 GiB / 32 over ~1 MiB a token: 191 tokens beyond a step
    assert chosen.expert_slots < plain.expert_slots
    assert plain.expert_budget - chosen.expert_budget == chosen.reserve_bytes - plain.reserve_bytes
    assert chosen.reserve_bytes - plain.reserve_bytes <= MOST_RESERVE_SHARE * plain.expert_budget


def test_no_rates_without_a_gpu():
    assert measured_prefill_rates(CPU) is None


def test_the_load_measures_the_rates_where_the_options_leave_the_chunk_open(tiny_dir, monkeypatch):
    """The load's plan gets the rates (as a GPU would measure them; this machine has none) unless the options fix
    the chunk; a CPU has no device memory for a longer chunk's reserve, so the chunk stays a step."""
    snapshot = tiny_dir("nvfp4-ct")
    config = ModelConfig.from_dir(snapshot)
    options = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16, prefix_cache=False,
                   moe_vram_budget=0)
    asked = []
    monkeypatch.setattr(engine.loading, "measured_prefill_rates",
                        lambda device: asked.append(device) or link_for(config, 40, slots=0))
    assert LLM(snapshot, "cpu", "float32", **options).core.plan.prefill_tokens == 16
    assert asked == [CPU]
    assert LLM(snapshot, "cpu", "float32", max_prefill_tokens=32, **options).core.plan.prefill_tokens == 32
    assert asked == [CPU]


def test_the_engine_prefills_a_lone_prompt_in_the_chosen_chunks(tiny_dir, monkeypatch):
    """An engine under a plan that chose 3 steps' tokens: its options carry them (the warm-up compiles for
    them), a lone prompt prefills in chunks of them, and the tokens are those of a run in decode-sized steps."""
    snapshot = tiny_dir("nvfp4-ct")
    step = 16
    options = EngineOptions(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=step, prefix_cache=False,
                            moe_vram_budget=0)
    loaded = load_checkpoint(snapshot, CPU, "float32", options, workers=2)
    sizes = checkpoint_sizes(snapshot, loaded.config)
    rates = PrefillRates(link=1.0, matmul=1e12)
    per_expert = sizes.experts // (sizes.expert_layers * loaded.config.n_routed_experts)
    link = loaded.config.n_routed_experts * per_expert / (2.5 * step * token_seconds(loaded.config, rates))
    plan = plan_memory(loaded.config, options, CPU, torch.float32, sizes, 64 << 30,
                       lambda: dataclasses.replace(rates, link=link))
    assert plan.prefill_tokens == 3 * step and plan.expert_slots == loaded.plan.expert_slots == 0
    core = EngineCore(loaded.config, loaded.weights, options, plan=plan)
    assert core.options.max_prefill_tokens == 3 * step
    steps = []
    run = core.runner.run
    monkeypatch.setattr(core.runner, "run", lambda step_plan, *args, **kwargs: steps.append(
        sum(span.num_new for span in step_plan.spans)) or run(step_plan, *args, **kwargs))
    prompt = list(range(3, 3 + 7 * step))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    chunked = run_together(core, [Sequence("lone", prompt, params)])[0]
    assert steps[:3] == [3 * step, 3 * step, step]  # 112 tokens: two chunks of 48 and the last 16
    stepwise = LLM(snapshot, "cpu", "float32", **{f: getattr(options, f) for f in (
        "max_num_seqs", "max_model_len", "max_num_batched_tokens", "prefix_cache", "moe_vram_budget")})
    assert stepwise.core.options.max_prefill_tokens is None
    assert chunked.output_token_ids == stepwise.generate([prompt], params)[0].token_ids
