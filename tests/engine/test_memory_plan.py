"""The memory plan: made once before the load, from the free memory, the options and the model; the caches it
sizes are the ones the engine allocates, and the offline `LLM` and the server get the same plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM
from engine.cache.state_rows import state_bytes
from engine.checkpoint.loader import checkpoint_sizes
from engine.config import ModelConfig
from engine.memory_plan import AUTO, WeightBytes, build_caches, plan_memory, reserve_bytes
from engine.options import EngineOptions
from worker.settings import Settings
from worker.engine_options import engine_options

CPU = torch.device("cpu")
SIZES = EngineOptions(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128, prefix_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def config(tiny_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir("nvfp4-ct"))


def plan(config: ModelConfig, budget: int | str | None, device: torch.device = CPU, free: int | None = None,
         weights: WeightBytes | None = None):
    """The plan for SIZES with an expert budget, over weights of 1000 bytes plus 50 a routed expert."""
    experts = 50 * len(config.moe_layers) * config.n_routed_experts
    weights = weights or WeightBytes(1000 + experts, experts, len(config.moe_layers))
    return plan_memory(config, dataclasses.replace(SIZES, moe_vram_budget=budget), device, torch.float32, weights,
                       free)


def test_the_plan_places_experts_before_loading(config):
    layers, experts = len(config.moe_layers), config.n_routed_experts
    assert (plan(config, None).expert_budget, plan(config, None).expert_slots) == (None, None)
    assert (plan(config, 3 * layers * 50).expert_budget, plan(config, 3 * layers * 50).expert_slots) == (
        3 * layers * 50, 3)
    assert plan(config, 10 ** 9).expert_slots == experts  # never more than all
    assert (plan(config, AUTO).expert_budget, plan(config, AUTO).expert_slots) == (0, 0)  # no GPU memory to fill
    with pytest.raises(ValueError, match=">= 0 bytes"):
        plan(config, -1)


def test_the_mtp_layers_experts_share_the_budget_where_they_are_placed(config):
    """Where the MTP layer is loaded and stored as the decoder layers' are, its experts are placed like theirs
    (the sizes say so: `checkpoint_sizes`); where not (the NVFP4 releases), its bytes are the device's."""
    layers, experts = len(config.moe_layers), 50 * len(config.moe_layers) * config.n_routed_experts
    assert layers >= 3
    budget = 4 * layers * 50  # four slots a layer over the model's layers, three once the MTP layer counts
    drafting = dataclasses.replace(SIZES, moe_vram_budget=budget, speculative_tokens=2)
    assert plan(config, budget).expert_slots == 4
    with_mtp = WeightBytes(1000 + experts + 50 * config.n_routed_experts, experts + 50 * config.n_routed_experts,
                           layers + 1)
    assert plan_memory(config, drafting, CPU, torch.float32, with_mtp).expert_slots == 3


def test_auto_is_what_the_other_weights_the_caches_and_the_reserve_leave(config):
    free = 50 * 2 ** 30
    auto = plan(config, AUTO, free=free)
    others = 1000
    assert auto.expert_budget == free - auto.reserve_bytes - others - auto.cache_bytes
    tight = auto.reserve_bytes + others + auto.cache_bytes
    assert plan(config, AUTO, free=tight).expert_budget == 0  # the caches fit, and nothing is left
    latent_tokens = auto.latent_pages * SIZES.page_size
    with pytest.raises(ValueError, match=rf"max_model_len 256 x max_num_seqs 2 .* at most {latent_tokens - 1} \("):
        plan(config, AUTO, free=tight - 1)  # a token short: the plan says how much context fits
    in_memory = plan_memory(config, dataclasses.replace(SIZES, moe_vram_budget=AUTO), CPU, torch.float32, None, free)
    assert in_memory.expert_budget == free - in_memory.reserve_bytes - in_memory.cache_bytes
    # Weights already in memory (placed by their loader): a tight device is said, not refused.
    placed = plan_memory(config, dataclasses.replace(SIZES, moe_vram_budget=AUTO), CPU, torch.float32, None,
                         in_memory.reserve_bytes + in_memory.cache_bytes - 1)
    assert placed.expert_budget == 0 and placed.most_context_tokens < latent_tokens
    assert in_memory.expert_slots is None  # the engine places the stacks already in memory under the budget


def test_unset_budget_is_auto_only_on_a_gpu_the_weights_do_not_fit(config):
    cuda = torch.device("cuda")  # the plan only reads the device's type when its free memory is given
    fits = plan(config, None, cuda, free=10 ** 12)
    assert fits.expert_budget is None and fits.expert_slots is None
    tight = plan(config, None, cuda, free=fits.reserve_bytes + fits.cache_bytes + 1000 + 50 * 4)
    assert tight.expert_budget == 50 * 4 and tight.expert_slots == 4 // len(config.moe_layers)
    assert plan(config, None, CPU, free=0).expert_budget is None  # the CPU serves from its own memory
    assert plan(config, 123).expert_budget == 123  # what was asked for stands


def test_an_automatic_budget_keeps_room_for_one_host_banks_copy(config):
    """Under hybrid offload a prefill-sized batch runs its missed experts from a device copy of the layer's host
    bank (its experts and a spare entry): the budget the device leaves holds it beside the slots; an explicit
    budget is the slots' alone."""
    cuda = torch.device("cuda")  # the plan only reads the device's type when its free memory is given
    layers, experts = len(config.moe_layers), config.n_routed_experts
    fixed = plan(config, None, cuda, free=10 ** 12)
    others = fixed.reserve_bytes + fixed.cache_bytes + 1000
    budget = 50 * (8 * layers + (experts - 8) + 1)  # 8 slots a layer, and the bank of the others with its spare
    auto = plan(config, AUTO, cuda, free=others + budget)
    assert (auto.expert_budget, auto.expert_slots) == (budget, 8)
    assert plan(config, AUTO, cuda, free=others + budget - 1).expert_slots == 7
    assert plan(config, budget).expert_slots == budget // (50 * layers) > 8


def test_the_reserve_grows_with_the_largest_step():
    """2 GiB, 1 MiB a token of the largest step, 4 bytes a (token, context token) pair: 4.06 GiB at the defaults
    (2,048 tokens, 8,192 of context) where a fixed 8% of an H200 kept 10.5 GiB back."""
    gib, mib = 2 ** 30, 2 ** 20
    assert reserve_bytes(0, 8192) == 2 * gib
    assert reserve_bytes(2048, 8192) == 2 * gib + 2048 * mib + 2048 * 8192 * 4
    assert reserve_bytes(2048, 131072) - reserve_bytes(2048, 8192) == 2048 * (131072 - 8192) * 4


def test_a_longer_lone_prefill_step_is_reserved_for_and_shrinks_the_auto_budget(config):
    """max_prefill_tokens above max_num_batched_tokens is the largest step: the reserve follows it, and the
    automatic expert budget gives up the difference; below, nothing changes."""
    free = 64 << 30
    weights = WeightBytes(1000, 0, len(config.moe_layers))
    plans = {tokens: plan_memory(config, dataclasses.replace(SIZES, moe_vram_budget=AUTO, max_prefill_tokens=tokens),
                                 torch.device("cuda"), torch.float32, weights, free)
             for tokens in (None, 64, 1024)}
    assert dataclasses.replace(plans[64], prefill_tokens=None) == plans[None] and plans[64].prefill_tokens == 64
    assert plans[None].reserve_bytes == reserve_bytes(SIZES.max_num_batched_tokens, SIZES.max_model_len)
    assert plans[1024].reserve_bytes == reserve_bytes(1024, SIZES.max_model_len)
    assert plans[None].expert_budget - plans[1024].expert_budget == \
        plans[1024].reserve_bytes - plans[None].reserve_bytes
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineOptions(max_prefill_tokens=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_caches_it_counts_are_the_ones_the_engine_allocates(config, dtype, kv_cache_dtype):
    sizes = dataclasses.replace(SIZES, kv_cache_dtype=kv_cache_dtype)
    made = plan_memory(config, sizes, CPU, dtype)
    assert made.prefix_device.snapshots > 0 and made.prefix_device.pages > 0
    slots, latents = build_caches(config, sizes, made, CPU, dtype)
    allocated = sum(t.numel() * t.element_size() for cache in (slots, latents) for t in vars(cache).values()
                    if isinstance(t, torch.Tensor))
    assert latents.num_pages == made.request_pages + made.prefix_device.pages
    fp8 = kv_cache_dtype == "fp8"
    assert latents.latents.dtype == (torch.float8_e4m3fn if fp8 else dtype)
    assert made.cache_bytes == allocated + made.prefix_device.snapshots * state_bytes(config, SIZES.page_size, dtype,
                                                                                      fp8)


def test_the_offline_llm_and_the_server_make_the_same_plan(tiny_dir):
    snapshot = tiny_dir("nvfp4-ct")
    llm = LLM(snapshot, "cpu", "float32", max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128,
              moe_vram_budget=0)
    settings = Settings(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128, moe_vram_budget_gib=0.0,
                        prefix_cache_gib=4.0)
    config = ModelConfig.from_dir(snapshot)
    served = plan_memory(config, engine_options(settings), CPU, torch.float32, checkpoint_sizes(snapshot, config))
    assert llm.core.plan == served
    assert llm.core.offload is not None and len(llm.core.offload.resident[config.moe_layers[0]]) == 0
    assert llm.core.cache.num_pages == served.latent_pages
