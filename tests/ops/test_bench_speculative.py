"""ops/bench_speculative.py on the tiny model's shapes, all experts resident and under hybrid offload: every figure
reported for k = 1 and 2, the MTP layer's own drafts' output equal to plain decoding (the benchmark stops
otherwise in float32), and the forced acceptance what the verify steps reached at 0 and 1."""

from __future__ import annotations

import json

import pytest

from ops import bench_speculative as bench


@pytest.mark.parametrize("hybrid", [[], ["--expert-slots", "2"]])
def test_tiny_run_reports_each_acceptance(tmp_path, hybrid):
    report = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--format", "bf16", "--tokens", "6",
                         "--prompt", "12", "--batches", "1,2", "--drafts", "1,2", "--acceptance", "0,1", "--json",
                         str(tmp_path / "r.json"), "--prefill", "40", *hybrid])
    assert report.get("expert_slots_per_layer") == (2 if hybrid else None)
    assert isinstance(report["prefill40_tok_s"], float)  # a prompt longer than the table's, on the same engine
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert [row["batch"] for row in report["results"]] == [1, 2]
    keys = {"decode_ms_per_step", "decode_tok_s", "eager_decode_ms_per_step", "drafting_ms_per_step",
            "drafting_cost"} | {f"k{k}_{figure}" for k in (1, 2)
                                for figure in ("step_ms", "step_cost", "own_acceptance", "same_tokens",
                                               "tok_s_at_0.0", "tok_s_at_1.0", "accepted_at_0.0", "accepted_at_1.0")}
    for row in report["results"]:  # the figures themselves are timings of a loaded 2-core machine: not checked
        assert keys <= row.keys() and all(isinstance(row[k], float) for k in keys)
        assert row["k1_graph_verify_steps"] == row["k2_graph_verify_steps"] == 0  # no graphs on a CPU
        assert row["k1_accepted_at_0.0"] == row["k2_accepted_at_0.0"] == 0.0  # every forced draft wrong
        assert row["k1_accepted_at_1.0"] == row["k2_accepted_at_1.0"] == 1.0  # every forced draft right
        assert row["k1_same_tokens"] == row["k2_same_tokens"] == 1.0
