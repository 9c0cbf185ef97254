"""ops/bench_latent_cache.py on the tiny model: the accuracy report's figures for the fp8 cache and its bf16
yardstick, and the context report's rows for both caches (timings of a loaded 2-core machine: not checked)."""

from __future__ import annotations

import json

from ops import bench_latent_cache as bench


def test_accuracy_reports_the_fp8_cache_beside_bf16_serving(tmp_path):
    report = bench.main(["accuracy", "--device", "cpu", "--tiny", "--prompt", "40", "--tokens", "48", "--json",
                         str(tmp_path / "a.json")])
    assert json.loads((tmp_path / "a.json").read_text()) == report
    for name in ("fp8_cache", "bf16_activations"):
        figures = report[name]
        assert 0 < figures["mean_abs"] <= figures["max_abs"] and figures["mean_kl"] > 0
        assert 0.5 < figures["top1_agreement"] <= 1 and 0 <= figures["equal_share"] <= 1
        assert 0 <= figures["first_departure"] <= 48
    # The fp8 cache's loss is bf16 serving's order of size (tests/engine/test_fp8_latent_cache.py bounds it).
    assert report["fp8_cache"]["mean_abs"] < 3 * report["bf16_activations"]["mean_abs"]


def test_context_reports_decode_at_each_length_for_each_cache():
    report = bench.main(["context", "--device", "cpu", "--tiny", "--contexts", "40,100", "--tokens", "4"])
    rows = report["rows"]
    assert [(r["cache"], r["context"]) for r in rows] == [("auto", 40), ("auto", 100), ("fp8", 40), ("fp8", 100)]
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in rows)
    assert [r["decode_vs_shortest"] for r in rows][::2] == [1.0, 1.0]
    auto, fp8 = rows[0]["context_token_bytes"], rows[2]["context_token_bytes"]
    assert fp8 < auto and rows[0]["most_context_tokens"] is None  # no device measure on a CPU
