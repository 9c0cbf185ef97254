"""ops/bench_handshake.py on CPU: every chain runs and reports; the hybrid chain (every routed expert resident)
computes what the device executor alone does."""

from __future__ import annotations

import torch

from engine.experts import executor_class
from engine.experts.hybrid import HybridExperts
from ops import bench_handshake as bench
from ops.bench_cpu_moe import nvfp4_stack


def test_smoke_run_reports_every_chain(capsys):
    result = bench.main(["--device", "cpu", "--layers", "2", "--rows", "2", "--reps", "2"])
    assert result["device_only_ms"] > 0 and result["doorbell_ms"] > 0 and result["host_function_ms"] > 0
    assert not result["graphed"]
    out = capsys.readouterr().out
    assert '"doorbell_us_per_layer"' in out and '"host_function_us_per_layer"' in out


def test_hybrid_chain_with_every_routed_expert_resident_equals_the_device_chain():
    gen = torch.Generator().manual_seed(1)
    stacks = {0: tuple(nvfp4_stack(bench.EXPERTS, n, k, gen) for n, k in
                       ((bench.INTER, bench.HIDDEN), (bench.INTER, bench.HIDDEN), (bench.HIDDEN, bench.INTER)))}
    cpu = torch.device("cpu")
    hybrid = HybridExperts.place(stacks, {0: list(range(bench.EXPERTS - 1))}, cpu, 7.0, executor_class(cpu))
    device_only = executor_class(cpu)(hybrid.device_stacks, 7.0)
    x = torch.randn(3, bench.HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(bench.EXPERTS - 1, generator=gen)[:bench.TOP_K] for _ in range(3)])
    w = torch.rand(3, bench.TOP_K, generator=gen)
    torch.testing.assert_close(hybrid(0, x, ids, w), device_only(0, x, ids, w))
    assert hybrid.stats.host_pairs == 0
