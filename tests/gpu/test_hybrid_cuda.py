"""Hybrid expert offload on CUDA: device slots on the Triton kernels, misses on the CPU, swaps while
requests run; the outputs equal the all-resident engine's (runs only where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.experts import TritonExperts
from engine.experts.hybrid import HybridExperts
from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts.gather import gather_experts_torch, gather_experts_triton, gather_plan
from engine.offload.host_memory import host_copy
from engine.prefill_chunk import measured_prefill_rates
from engine.tiny.factory import write_tiny_model
from engine.weights import map_tensors, tensor_fields
from ops.bench_cpu_moe import D, nvfp4_stack
from tests.engine.conftest import random_prompt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


@pytest.mark.parametrize("fmt", ["nvfp4-ct", "fp8"])
def test_tiny_model_hybrid_on_cuda_gives_the_same_tokens(tmp_path, fmt):
    snapshot = write_tiny_model(tmp_path / fmt, fmt)
    resident = LLM(snapshot, "cuda", "float32", max_model_len=256)
    probe = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=0)
    budget = 3 * probe.core.offload.expert_bytes * len(probe.config.moe_layers)
    hybrid = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=budget)
    assert all(getattr(s[0], "packed", getattr(s[0], "data", None)).is_pinned()
               for s in hybrid.core.offload.host.values())
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 17, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, params)]
    assert [o.token_ids for o in hybrid.generate(prompts, params)] == want
    stats = hybrid.core.stats().offload
    assert stats.host_pairs > 0 and stats.device_pairs > 0 and stats.swaps > 0
    # the load chose the prefill chunk from the measured rates (the prompts above ran in its steps)
    assert hybrid.core.plan.prefill_tokens == hybrid.core.options.max_prefill_tokens >= 2048


def test_the_prefill_rates_a_start_measures_are_a_links_and_a_matmuls():
    """The pinned copy and the chunk-shaped bf16 matmul the memory plan chooses a prefill chunk from: PCIe 3-6
    rates (4-64 GB/s) and tens to thousands of TFLOP/s, not a timer's artefact."""
    rates = measured_prefill_rates(torch.device("cuda"))
    assert 4e9 < rates.link < 64e9
    assert 20e12 < rates.matmul < 3e15


def test_a_pinned_host_bank_is_gathered_by_the_device_whole_and_in_parts():
    """Release-shape NVFP4 stacks in pinned host memory: the one-launch gather (reading host memory over PCIe)
    stages an expert whole, the first 5 of 16 parts of another, nothing for a slot without an entry, byte for
    byte as the torch reference does on the CPU."""
    gen = torch.Generator().manual_seed(3)
    host = tuple(map_tensors(s, lambda t: host_copy(t, pin=True))
                 for s in (nvfp4_stack(6, 2048, D, gen), nvfp4_stack(6, 2048, D, gen), nvfp4_stack(6, D, 2048, gen)))
    assert host[0].packed.is_pinned()
    staged = {device: tuple(map_tensors(s, lambda t: torch.ones((3, *t.shape[1:]), dtype=t.dtype, device=device))
                            for s in host) for device in ("cuda", "cpu")}
    entries, parts = torch.tensor([3, -1, 1]), torch.tensor([16, 0, 5])
    gather_experts_triton(gather_plan(staged["cuda"], host, 16), entries.cuda(), parts.cuda())
    gather_experts_torch(gather_plan(staged["cpu"], host, 16), entries, parts)
    for got, want in zip(staged["cuda"], staged["cpu"]):
        for name in tensor_fields(want):
            assert torch.equal(getattr(got, name).cpu().view(torch.uint8), getattr(want, name).view(torch.uint8))
    assert torch.equal(staged["cpu"][0].packed[0], host[0].packed[3])


@pytest.mark.parametrize("tokens,pcie", [(1, 0), (8, 0), (1, 60), (8, 60)])
def test_release_shape_hybrid_matches_the_reference(tokens, pcie):
    """288 NVFP4 experts of the release's shape, 16 in device slots on the Triton kernels, the rest on the CPU
    (`pcie`: that share of the misses gathered over PCIe from the pinned bank and run on the GPU), eager and
    replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(tokens)
    host = (nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, D, 2048, gen))
    hybrid = HybridExperts.place({0: host}, {0: list(range(0, 288, 18))}, torch.device("cuda"), 7.0, TritonExperts,
                                 pcie_percent=pcie)
    x = torch.randn(tokens, D, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(288, generator=gen)[:8] for _ in range(tokens)]).cuda()
    ids[:, 0] = 18 * torch.arange(1, tokens + 1)  # a device hit in every token
    w = torch.rand(tokens, 8, generator=gen).cuda()
    got = hybrid(0, x, ids, w)
    on_device = TorchExperts({0: tuple(map_tensors(s, lambda t: t.cuda()) for s in host)}, 7.0)
    want = on_device(0, x.float(), ids, w)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err  # bf16 activations against fp32
    assert hybrid.stats.host_pairs > 0 and hybrid.stats.device_pairs >= tokens
    assert (hybrid.stats.fetched_pairs > 0) == (pcie > 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = hybrid(0, x, ids, w)
    hybrid.use_rows(tokens)  # what DecodeGraphs tells it before each replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, got, rtol=0, atol=0)  # the same pairs on the same paths


def test_release_shape_swaps_under_a_replayed_graph_keep_outputs():
    """Experts move between the GPU slots and the pinned bank (copy streams) while replays of one captured
    decode step run, with the PCIe share on: every replay equals the reference for its routing."""
    gen = torch.Generator().manual_seed(11)
    host = (nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, D, 2048, gen))
    reference = TorchExperts({0: tuple(map_tensors(s, lambda t: t.cuda()) for s in host)}, 7.0)
    hybrid = HybridExperts.place({0: host}, {0: list(range(16))}, torch.device("cuda"), 7.0, TritonExperts,
                                 pcie_percent=50)
    tokens = 4
    x = torch.randn(tokens, D, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.zeros(tokens, 8, dtype=torch.long, device="cuda")
    w = torch.rand(tokens, 8, generator=gen).cuda()
    hot = torch.arange(100, 140)  # routed to again and again: the swaps bring them into the slots
    ids.copy_(torch.stack([hot[torch.randperm(40, generator=gen)[:8]] for _ in range(tokens)]))
    hybrid(0, x, ids, w)  # eager first: the host steps exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hybrid(0, x, ids, w)
    for step in range(8):
        ids.copy_(torch.stack([hot[torch.randperm(40, generator=gen)[:8]] for _ in range(tokens)]))
        hybrid.use_rows(tokens)
        graph.replay()
        want = reference(0, x.float(), ids, w)
        err = ((out.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, (step, err)
        hybrid.rebalance(max_swaps=8)  # commits the last move, starts the next: its copies run beside the replay
    assert hybrid.stats.swaps > 0 and len(set(hybrid.resident[0]) & set(hot.tolist())) > 0


def test_auto_budget_takes_the_memory_the_caches_leave(tmp_path):
    """On an H200 the tiny model's experts all fit the automatic budget: every one gets a slot."""
    snapshot = write_tiny_model(tmp_path / "auto", "nvfp4-ct")
    llm = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget="auto")
    assert {len(r) for r in llm.core.offload.resident.values()} == {llm.config.n_routed_experts}
    out = llm.generate([random_prompt(12, seed=1)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 8 and llm.core.stats().offload.host_pairs == 0


def test_prefill_sized_batches_fetch_their_experts():
    """A 256-token batch at the release's shape: its misses are copied to the GPU in rounds of 8, two staging stacks taking turns."""
    gen = torch.Generator().manual_seed(5)
    host = (nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, 2048, D, gen), nvfp4_stack(288, D, 2048, gen))
    hybrid = HybridExperts.place({0: host}, {0: list(range(16))}, torch.device("cuda"), 7.0, TritonExperts)
    x = torch.randn(256, D, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(288, generator=gen)[:8] for _ in range(256)]).cuda()
    w = torch.rand(256, 8, generator=gen).cuda()
    got = hybrid(0, x, ids, w)
    want = TorchExperts({0: tuple(map_tensors(s, lambda t: t.cuda()) for s in host)}, 7.0)(0, x.float(), ids, w)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err
    assert hybrid.stats.fetched_pairs > 0 and hybrid.stats.host_pairs == 0


def test_the_miss_split_is_measured_once_then_kept(tmp_path, caplog):
    """The first start measures the CPU and PCIe rates and keeps them beside the snapshot; the next one on
    the same machine and weights reads them back and splits the same way."""
    snapshot = write_tiny_model(tmp_path / "nvfp4-ct", "nvfp4-ct")
    probe = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=0)
    budget = 3 * probe.core.offload.expert_bytes * len(probe.config.moe_layers)
    rates = tmp_path / "miss_split.json"
    with caplog.at_level("INFO", logger="glmflash.engine"):
        first = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=budget, miss_split_file=rates)
        again = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=budget, miss_split_file=rates)
    splits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=miss_split ")]
    assert "rates=measured" in splits[0] and "rates=kept" in splits[1], splits
    assert rates.exists() and first.core.offload.rates_at_load == again.core.offload.rates_at_load
    assert first.core.offload.pcie_percent == again.core.offload.pcie_percent


def test_cpu_expert_threads_are_pinned_with_a_gpu(tmp_path):
    """With a GPU (and no CPU quota) each CPU expert thread runs on a core of its own, the first core left
    free; GLMFLASH_CPU_EXPERT_PIN=false (cpu_expert_pin) leaves them floating."""
    from engine.kernels.experts import cpu_gemv
    from engine.cpu_cores import allowed_cpus, quota_cores, worker_cpus
    from tests.engine.test_cpu_cores import expert_threads

    if quota_cores() < len(allowed_cpus()) or len(allowed_cpus()) < 3:
        pytest.skip("a CPU quota or fewer than three CPUs: the threads float by design")
    snapshot = write_tiny_model(tmp_path / "nvfp4-ct", "nvfp4-ct")
    try:
        llm = LLM(snapshot, "cuda", "float32", max_model_len=256, moe_vram_budget=0)
        llm.generate([random_prompt(8, seed=1)], SamplingParams(max_tokens=2, temperature=0.0))
        want = worker_cpus(llm.core.offload.host_run.threads)
        assert want, "worker_cpus gave no cores on a machine without a quota"
        assert {str(cpu) for cpu in want} <= set(expert_threads().values())
        assert str(allowed_cpus()[0]) not in expert_threads().values()
    finally:
        cpu_gemv.pin_workers([])
