"""What a start runs so the first requests do not pay for it: the kernels an earlier start compiled and fla's
tuning (begun with the weight reads), the decode graphs, a decode probe for the boot log, prefills of every
length class, and the routing calibration that seeds hybrid placement. Each drives the engine through its
public methods (add, step, has_work) or its runner."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.kernels.dispatch import fast_kernels_enabled
from engine.kernels.kda.fla_prefill import start_kda_warm_up
from engine.kernels.kda.fla_tuning import use_tuned_configs
from engine.kernels.kernel_manifest import COMPILES, model_shapes, start_preload
from engine.kernels.token_variants import covering_lengths
from engine.options import EngineOptions
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.engine_core import EngineCore

log = logging.getLogger("glmflash.engine")


def start_warm_up(config: ModelConfig, device: torch.device, dtype: torch.dtype, kernels_file: Path | None = None,
                  precompile_processes: int | None = None) -> Future:
    """Start the warm-up that needs only the config in the background: the preload of the Triton kernels an
    earlier start recorded in `kernels_file` (this one records its own there) and fla's KDA-prefill autotuning,
    after it. A loader calls it before reading the weights, the engine waits on it before its first kernel; a
    second call returns the same work. On the CPU (or with the fast kernels off) there is nothing to warm: a
    finished future."""
    if device.type == "cuda" and fast_kernels_enabled():
        if device.index is None:  # one warm-up for "cuda" (a loader's) and "cuda:0" (the weights')
            device = torch.device("cuda", torch.cuda.current_device())
        use_tuned_configs(torch.cuda.get_device_capability(device))  # before the preload imports fla
        preload = start_preload(kernels_file, device, dtype, model_shapes(config), precompile_processes)
        return start_kda_warm_up(device, config.linear_num_heads, config.linear_head_dim, dtype, after=preload)
    done: Future = Future()
    done.set_result(None)
    return done


def wait_for_warm_up(config: ModelConfig, options: EngineOptions, device: torch.device, dtype: torch.dtype) -> None:
    """Before the engine's first kernel: the kernels an earlier start compiled are compiled again (or read from
    Triton's cache) and fla's prefill kernels tuned, both started with the reads; neither then competes with
    the engine's own GPU work (placement timings, graph capture)."""
    start = time.perf_counter()
    start_warm_up(config, device, dtype, options.kernels_file, options.precompile_processes).result()
    log.info("event=warm_up_wait waited_s=%.2f", time.perf_counter() - start)


def warm_up(core: EngineCore) -> None:
    """A new engine's warm-up: decode graphs (deferred while experts are still filling in), the decode probe,
    then prefills of every length class, and the count of what the start compiled (CUDA)."""
    fast = core.model.device.type == "cuda" and fast_kernels_enabled()
    if fast and core.options.cuda_graphs and core.expert_fill is not None:
        log.info("event=decode_graphs deferred=experts_loading")  # missing experts are loaded inside steps
    else:
        _capture_graphs_if_allowed(core)
    report_decode_rate(core)
    if fast and core.expert_fill is None:
        warm_up_prefills(core)
    if core.model.device.type == "cuda":  # what the start compiled; from here on each compile is logged on its own
        log.info("event=kernel_compiles %s", COMPILES.started())


def after_expert_fill(core: EngineCore) -> None:
    """Once every expert is in place: the decode graphs that were deferred (CUDA), and the decode probe."""
    _capture_graphs_if_allowed(core)
    report_decode_rate(core)


def warm_up_prefills(core: EngineCore) -> None:
    """Prefills of random tokens, one step each, so the compiles a step's token count can call for happen in the
    start, not in the first requests: the longest step, which runs every kernel launcher once, then one length
    per combination of builds it has not taken (engine/kernels/token_variants.py). Outside the prefix cache
    (which would hold back a prompt's last token, and keep random prompts); the engine is idle after, its slots
    free. Recorded with the kernel manifest; a later start whose preload read every kernel of it, under the same
    longest step, offload, latent cache and drafts, skips them (`CompileLog.covered_prefills`)."""
    if core.has_work:
        raise RuntimeError("the prefill warm-up needs an idle engine")
    start = time.perf_counter()
    longest = min(core.options.largest_step, core.options.max_model_len - 1)
    signature = {"longest": longest, "hybrid": core.offload is not None, "kv_cache_dtype": core.options.kv_cache_dtype,
                 "drafts": core.drafter.k if core.drafter is not None else 0}
    covered = COMPILES.covered_prefills(signature)
    if covered is not None:
        COMPILES.warmed = {"signature": signature, "lengths": covered}  # still true for the next start
        log.info("event=prefill_warm_up skipped=kernels_preloaded lengths=%s", ",".join(map(str, covered)))
        return
    g = torch.Generator().manual_seed(0)
    seconds = []
    with core.scheduler.prefix_cache_off():
        lengths = [longest]
        for index, length in enumerate(lengths):  # the others join once the longest has run every launcher
            prompt = torch.randint(core.config.vocab_size, (length,), generator=g).tolist()
            begun = time.perf_counter()
            _run_to_end(core, [Sequence(f"warm-up-prefill-{index}", prompt, SamplingParams(max_tokens=1))])
            seconds.append(time.perf_counter() - begun)
            if index == 0:
                lengths += covering_lengths(longest, done=lengths)
    COMPILES.warmed = {"signature": signature, "lengths": lengths}
    log.info("event=prefill_warm_up lengths=%s seconds=%.1f each_s=%s", ",".join(map(str, lengths)),
             time.perf_counter() - start, ",".join(f"{t:.2f}" for t in seconds))


def calibrate_routing(core: EngineCore, prompts: list[list[int]]) -> int:
    """Prefill each prompt once (a calibration set) so hybrid placement starts from its routing: the experts it
    routes to most move into device slots now, or over the first steps while swaps are held. -> swaps made
    now."""
    if core.offload is None or not prompts:
        return 0
    if core.has_work:
        raise RuntimeError("routing calibration needs an idle engine")
    keep = core.options.max_model_len - 1
    _run_to_end(core, [Sequence(f"routing-calibration-{index}", ids[:keep], SamplingParams(max_tokens=1))
                       for index, ids in enumerate(p for p in prompts if p)])
    core.offload.settle_all = True
    return core.offload.rebalance(0)


def report_decode_rate(core: EngineCore, steps: int = 8) -> None:
    """The boot log's expected tok/s: batch-1 decode steps timed as requests run them, with a GPU or with experts
    on the host (where placement decides the rate); not while experts are still loading."""
    if core.expert_fill is not None or (core.offload is None and core.model.device.type != "cuda"):
        return
    step = core.runner.time_decode(steps, core.config.vocab_size)
    log.info("event=decode_probe batch=1 step_ms=%.2f expected_tok_s=%.1f graphs=%s", step * 1e3, 1 / step,
             "yes" if core.runner.graphs is not None else "no")


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to the slot count, and the slot count itself: a step pads to the next size."""
    sizes = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    return tuple(sorted(sizes | {max_num_seqs}))


def _run_to_end(core: EngineCore, requests: list[Sequence]) -> None:
    for seq in requests:
        core.add(seq)
    while core.has_work:
        core.step()


def _capture_graphs_if_allowed(core: EngineCore) -> None:
    """Decode graphs on CUDA with the fast kernels and graphs on; not where host experts in a format the
    compiled CPU kernels do not take run through a synchronizing path."""
    if not (core.model.device.type == "cuda" and fast_kernels_enabled() and core.options.cuda_graphs):
        return
    if core.offload is not None and not core.offload.graph_safe:
        log.info("event=decode_graphs skipped=host_experts_uncompiled")
        return
    sizes = graph_sizes(core.options.max_num_seqs)
    drafts = core.drafter.k if core.drafter is not None else 0
    before_replay = None if core.offload is None else core.offload.use_rows
    seconds = core.runner.capture_graphs(sizes, before_replay, tuple(range(1, drafts + 2)))
    if core.drafter is not None:
        seconds += core.drafter.capture_graphs(core.runner.graphs, before_replay)
    log.info("event=decode_graphs sizes=%s tokens_per_request=%s capture_s=%.2f", ",".join(map(str, sizes)),
             ",".join(str(n) for n in range(1, drafts + 2)), seconds)
