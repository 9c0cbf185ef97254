"""An engine's parts built from weights in memory, under one memory plan: the request slots and latent pages,
the prefix cache, the expert executor (hybrid when the plan gives experts a device budget; wrapped while
experts still fill in), the model, the scheduler and the runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.cache import PagedLatents, RequestSlots
from engine.cache.prefix_cache import PrefixCache
from engine.checkpoint.availability import ExpertAvailability
from engine.checkpoint.layout import EXPERT_PROJS, stacked_expert_name
from engine.checkpoint.loader import LoadedWeights
from engine.config import ModelConfig
from engine.experts import ExpertExecutor, default_executor, executor_class
from engine.experts.filling import FillingExperts
from engine.experts.hybrid import HybridExperts
from engine.kernels.dispatch import fast_kernels_enabled
from engine.memory_plan import MemoryPlan, build_caches, cache_config, plan_memory
from engine.model.glm5_next import Glm5NextModel
from engine.model.mtp import MtpLayer
from engine.model.vision import VisionTower, vision_weights
from engine.model_runner import ModelRunner
from engine.mtp_drafter import MtpDrafter
from engine.offload.miss_split import choose_split
from engine.options import EngineOptions
from engine.scheduler import Scheduler, SchedulerLimits
from engine.vision.embedder import ImageEmbedder
from engine.weights import stack_format
from engine.warm_up import wait_for_warm_up

log = logging.getLogger("glmflash.engine")


@dataclass(frozen=True)
class EngineParts:
    plan: MemoryPlan
    slots: RequestSlots
    cache: PagedLatents
    prefix: PrefixCache | None
    offload: HybridExperts | None  # experts split between device slots and the host (None: all resident)
    expert_fill: FillingExperts | None  # while routed experts still fill in (early readiness)
    model: Glm5NextModel
    scheduler: Scheduler
    runner: ModelRunner
    drafter: MtpDrafter | None  # the MTP layer's drafts (options.drafts_on, where it can run)


def build_parts(config: ModelConfig, weights: LoadedWeights, options: EngineOptions, plan: MemoryPlan | None,
                experts: ExpertAvailability | None) -> EngineParts:
    """`plan`: the one the weights were loaded under (None: weights built in memory; it is made here).
    `experts`: the fill of the routed experts, when they are still arriving."""
    embed = weights["embed_tokens.weight"]
    device, dtype = embed.device, embed.dtype
    if device.type == "cuda" and fast_kernels_enabled():
        wait_for_warm_up(config, options, device, dtype)
    plan = plan or plan_memory(config, options, device, dtype)
    slots, cache = build_caches(config, options, plan, device, dtype)
    prefix = _prefix_cache(cache_config(config, options), slots, cache, plan) if options.prefix_cache else None
    offload = _hybrid_experts(config, weights, options, plan)
    executor: ExpertExecutor = offload or default_executor(weights, config.moe_layers, config.swiglu_limit, device)
    fill = FillingExperts(executor, experts) if experts is not None and not experts.complete else None
    if offload is not None:
        offload.prefetch_banks = fill is None  # the fill writes host banks: no copy ahead of a layer's turn
    model = Glm5NextModel(config, weights, fill or executor)
    limits = SchedulerLimits(options.max_model_len, max(options.max_num_batched_tokens, options.max_num_seqs),
                             options.max_waiting, plan.prefill_tokens)
    scheduler = Scheduler(slots, cache, limits, prefix)
    runner = ModelRunner(model, slots, cache, cache.pages_for(options.max_model_len), _image_embedder(config, weights))
    drafter = mtp_drafter(config, weights, options, runner, offload, fill is not None) if options.drafts_on else None
    return EngineParts(plan, slots, cache, prefix, offload, fill, model, scheduler, runner, drafter)


def has_mtp_layer(config: ModelConfig, weights: LoadedWeights) -> bool:
    """Whether the MTP layer was loaded (drafts asked of a checkpoint that has one, every expert read)."""
    return f"layers.{config.num_layers}.eh_proj" in weights


def mtp_with_offload(config: ModelConfig, weights: LoadedWeights) -> bool:
    """Whether hybrid offload takes the MTP layer's experts: stored as the decoder layers' are (one staging
    format, one CPU kernel). The NVFP4 releases keep the MTP layer in FP8 blocks: its stacks stay whole on the
    device (the loaders and the memory plan keep them there: `unlike_expert_layers`) and run resident."""
    mtp, decoder = (weights[stacked_expert_name(layer, EXPERT_PROJS[0])] for layer in (config.num_layers,
                                                                                       config.moe_layers[0]))
    return stack_format(mtp) is stack_format(decoder)


def mtp_drafter(config: ModelConfig, weights: LoadedWeights, options: EngineOptions, runner: ModelRunner,
                offload: HybridExperts | None, filling: bool) -> MtpDrafter | None:
    """The MTP layer over the caches' last DSA index, its experts run by the engine's executor (placed with the
    other layers' under hybrid offload where stored alike, else resident), where it was loaded: the checkpoint
    has it, and the load was whole (a load that readies before its experts are in does not read it)."""
    index = config.num_layers
    reason = None if has_mtp_layer(config, weights) else "experts_filling" if filling else "no_mtp_layer"
    if reason is not None:
        log.info("event=mtp_drafts on=0 reason=%s", reason)
        return None
    device = weights["embed_tokens.weight"].device
    placed = offload is not None and index in offload.layers
    experts = offload if placed else default_executor(weights, [index], config.swiglu_limit, device)
    layer = MtpLayer(config, weights, index, experts)
    log.info("event=mtp_drafts on=1 layer=%d speculative_tokens=%d experts=%s", index, options.speculative_tokens,
             "hybrid" if placed else "resident")
    return MtpDrafter(cache_config(config, options), layer, runner, options.speculative_tokens,
                      options.measured_draft_length)


def _image_embedder(config: ModelConfig, weights: LoadedWeights) -> ImageEmbedder | None:
    """The vision tower over the loaded `visual.*` tensors (None: a checkpoint without one serves text)."""
    tower = vision_weights(weights)
    if config.vision is None or not tower:
        return None
    return ImageEmbedder(VisionTower(config.vision, tower), weights["embed_tokens.weight"].device)


def _prefix_cache(config: ModelConfig, slots: RequestSlots, cache: PagedLatents, plan: MemoryPlan) -> PrefixCache:
    device, host = plan.prefix_device, plan.prefix_host
    log.info("event=prefix_cache device_snapshots=%d device_pages=%d host_snapshots=%d host_pages=%d",
             device.snapshots, device.pages, host.snapshots, host.pages)
    return PrefixCache(config, slots, cache, device.snapshots, host)


def _hybrid_experts(config: ModelConfig, weights: LoadedWeights, options: EngineOptions,
                    plan: MemoryPlan) -> HybridExperts | None:
    """Experts split between device slots and the host bank when the plan gives them a budget (the MTP layer's
    with the others where it was loaded)."""
    if plan.expert_budget is None:
        return None
    device = weights["norm.weight"].device
    mtp = options.drafts_on and has_mtp_layer(config, weights) and mtp_with_offload(config, weights)
    layers = config.moe_layers + ([config.num_layers] if mtp else [])
    hybrid = HybridExperts.from_weights(weights, layers, config.swiglu_limit, device, plan.expert_budget,
                                        executor_class(device), options.cpu_expert_threads, options.cpu_expert_pin)
    hybrid.split_misses(*choose_split(hybrid, config.num_experts_per_tok, options.pcie_expert_percent,
                                      options.miss_split_file))
    slots = len(hybrid.resident[config.moe_layers[0]])
    gib_per_slot = hybrid.expert_bytes * len(layers) / 2 ** 30  # one expert in every MoE layer
    log.info("event=expert_placement device_slots_per_layer=%d of=%d device_gib=%.2f host_gib=%.2f",
             slots, hybrid.num_experts, gib_per_slot * slots, gib_per_slot * (hybrid.num_experts - slots))
    return hybrid
