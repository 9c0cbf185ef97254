"""ops/bench_experts.py end to end at tiny shapes on CPU (Triton's interpreter): it runs and its figures add up."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "bench_experts.py"
_spec = importlib.util.spec_from_file_location("bench_experts", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_experts"] = bench  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(bench)


def test_tiny_run_reports_both_paths(tmp_path, capsys):
    out = tmp_path / "experts.json"
    bench.main(["--device", "cpu", "--tiny", "--layers", "1", "--decode", "2", "--prefill", "40",
                "--iters", "1", "--repeats", "1", "--copy-mib", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(c["path"], c["tokens"]) for c in result["cases"]] == [("decode", 2), ("prefill", 40)]
    assert result["expert_bytes"] == 3 * (64 * 32 // 2 + 64 * 32 // 16 + 4)
    for case in result["cases"]:
        assert case["bytes"] == case["experts_read"] * result["expert_bytes"]
        assert 0 < case["experts_read"] <= 8 and case["triton_us"] > 0 and case["torch_us"] > 0
        assert abs(case["gbps"] - case["bytes"] / case["triton_us"] / 1e3) < 1e-6 * case["gbps"]
        assert case["rel_err"] < 2e-2  # bf16, and the interpreter truncates
        pairs = case["tokens"] * 4  # top-4 at tiny shapes
        assert abs(case["tflops"] - 6 * pairs * 64 * 32 / case["triton_us"] / 1e6) < 1e-6 * case["tflops"]
    assert "prefill" in capsys.readouterr().out


def test_the_same_experts_in_bf16_take_the_dense_path(tmp_path):
    """--weights bf16 times the kernels without the dequantization: the same experts, 16-bit bytes."""
    out = tmp_path / "experts.json"
    bench.main(["--device", "cpu", "--tiny", "--weights", "bf16", "--layers", "1", "--decode", "2", "--prefill", "40",
                "--iters", "1", "--repeats", "1", "--copy-mib", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["weights"] == "bf16" and result["expert_bytes"] == 3 * 64 * 32 * 2
    assert all(case["rel_err"] < 2e-2 for case in result["cases"])
