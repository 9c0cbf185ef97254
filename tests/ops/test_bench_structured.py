"""ops/bench_structured.py at tiny sizes on CPU: it runs, masks every constrained step, its figures add up and
it leaves the engine's methods as they were."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from engine.structured import RequestConstraint

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "bench_structured.py"
_spec = importlib.util.spec_from_file_location("bench_structured", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_structured"] = bench
_spec.loader.exec_module(bench)


def test_tiny_run_reports_each_batch(tmp_path, capsys):
    accept = RequestConstraint.accept
    out = tmp_path / "structured.json"
    bench.main(["--batch", "1", "3", "--steps", "4", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert RequestConstraint.accept is accept
    assert [c["batch"] for c in result["cases"]] == [1, 3]
    for case in result["cases"]:
        assert case["steps"] == 4 and case["free_step_ms"] > 0 and case["constrained_step_ms"] > 0
        assert case["fill_ms"] > 0 and case["apply_ms"] > 0 and case["accept_ms"] > 0  # every step was masked
        assert abs(case["mask_ms"] - (case["constrained_step_ms"] - case["free_step_ms"])) < 1e-9
        assert abs(case["overhead_pct"] - 100 * case["mask_ms"] / case["free_step_ms"]) < 1e-9
        assert abs(case["serial_ms"] - case["wait_ms"] - case["apply_ms"] - case["accept_ms"]) < 1e-9
    assert "serial" in capsys.readouterr().out
