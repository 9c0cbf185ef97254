"""GLMFLASH_READY_AT=partial: the server is ready before the routed experts are all in, answers with the
fully loaded server's greedy tokens meanwhile, shows the share in /ready, and writes the prepared
snapshot only once the fill is done; cold and fast_resume alike. A damaged piece the fill finds makes
the next start cold."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import engine.checkpoint.prepared_store as prepared_store
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version
from engine.checkpoint.prepared_store import PLAN_NAME, Region, check_prepared, piece_regions, read_plan
from server_helpers import MODEL_NAME, free_port, make_settings, start_server, stop_server, wait_until
import worker.serve
from worker.partial_ready import MIN_SHARE, reduced_max_perf
from worker.served_model import build_served_model

# The 15.5 MB of experts (conftest.many_experts) in about 10 s, while the warm-up and the requests below route to
# at most 2 x 12 experts per layer.
FILL_GBPS = 0.0015
DAMAGED_FILL_GBPS = 0.02  # the 99 MB of float32 experts read back from a prepared snapshot, in about 5 s


def ready(server) -> dict:
    status, _, body = server.get("/ready")
    assert status == 200, body
    return json.loads(body)


def greedy(server, prompt: str) -> list[str]:
    status, _, body = server.post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert status == 200, body
    return json.loads(body)["choices"][0]["logprobs"]["tokens"]


def test_partial_serves_before_the_experts_are_in_with_the_loaded_tokens(many_experts, tmp_path, monkeypatch):
    loaded = start_server(make_settings(many_experts, tmp_path / "loaded"))
    filling_while_built = []  # the fill starts with the load's end, not after the engine's build (its compiles)

    def build(loaded_model, settings):
        filling_while_built.append(any(t.name == "glmflash-expert-fill" for t in threading.enumerate()))
        return build_served_model(loaded_model, settings)

    monkeypatch.setattr(worker.serve, "build_served_model", build)
    partial = start_server(make_settings(many_experts, tmp_path / "partial", ready_at="partial",
                                         expert_fill_gbps=FILL_GBPS))
    try:
        assert "experts_loaded" not in ready(loaded)
        assert filling_while_built == [True]
        before = ready(partial)
        assert 0 < before["experts_loaded"] < 1 and before["prepared_snapshot"] == "after_experts"
        assert greedy(partial, "Hi") == greedy(loaded, "Hi")
        assert ready(partial)["experts_loaded"] < 1  # served before the load completed
        wait_until(lambda: ready(partial)["experts_loaded"] == 1.0, timeout=120, what="the expert fill")
        wait_until(lambda: ready(partial).get("prepared_snapshot") == "written", timeout=60,
                   what="the prepared snapshot, written after the fill")
        assert greedy(partial, "Hello there") == greedy(loaded, "Hello there")
        stop_server(partial)
        # The next start reads the prepared snapshot back (fast_resume), the experts again piece by piece (here
        # one 64 MiB piece holds a layer's whole projection, so the warm-up already brought every layer in).
        partial = start_server(partial.settings.model_copy(update={"port": free_port()}))
        resumed = ready(partial)
        assert [s["stage"] for s in resumed["stages"]][:2] == ["fast_resume", "load"]
        assert "experts_loaded" in resumed
        assert greedy(partial, "Hi") == greedy(loaded, "Hi")
    finally:
        stop_server(partial)
        stop_server(loaded)


def flip_every_piece(prepared: Path, region: Region) -> None:
    """One byte of each checksummed piece of `region`: whichever of them is read from now on is found damaged."""
    with open(prepared / region.file, "r+b") as f:
        for piece in piece_regions(region):
            f.seek(piece.offset)
            byte = f.read(1)
            f.seek(piece.offset)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_piece_found_by_the_fill_makes_the_next_start_cold(many_experts, tmp_path, monkeypatch, caplog):
    """fast_resume with partial: the experts are read while serving, where a damaged piece can no longer send this
    start down the cold path. It fails the fill (/ready: experts_loaded=failed), and the snapshot is invalidated
    (a line naming file and piece), so the next start is cold and serves the loaded server's tokens again."""
    # 64 KiB pieces instead of 64 MiB: this small model's layers become many pieces, most of which the warm-up
    # does not read, as a real model's are; the fill finds the damage, not the warm-up.
    monkeypatch.setattr(prepared_store, "PIECE_BYTES", 64 << 10)
    settings = make_settings(many_experts, tmp_path)
    server = start_server(settings)
    try:
        wait_until(lambda: ready(server).get("prepared_snapshot") == "written", timeout=60, what="the snapshot")
        expected = greedy(server, "Hi")
    finally:
        stop_server(server)
    prepared = next((tmp_path / "models").iterdir()) / "prepared"
    last = read_plan(prepared).regions[-1]  # the last the fill reads, seconds after ready at this rate

    server = start_server(settings.model_copy(update={"port": free_port(), "ready_at": "partial",
                                                      "expert_fill_gbps": DAMAGED_FILL_GBPS}))
    try:
        assert [s["stage"] for s in ready(server)["stages"]][:2] == ["fast_resume", "load"]
        flip_every_piece(prepared, last)
        wait_until(lambda: ready(server)["experts_loaded"] == "failed", timeout=60, what="the fill to fail")
    finally:
        stop_server(server)
    assert check_prepared(prepared, FORMAT_VERSION, engine_version()) == [f"{prepared / PLAN_NAME}: missing"]
    [line] = [r.getMessage() for r in caplog.records if "event=prepared_snapshot state=invalidated" in r.getMessage()]
    assert f"file={prepared / last.file} piece={last.key}@" in line, line

    server = start_server(settings.model_copy(update={"port": free_port(), "ready_at": "partial"}))
    try:
        assert [s["stage"] for s in ready(server)["stages"]][:2] == ["cold", "download"]
        assert greedy(server, "Hi") == expected
    finally:
        stop_server(server)


def test_vast_hears_the_full_figure_scaled_by_the_share_in_place():
    assert reduced_max_perf(100.0, 0.5) == 50.0
    assert reduced_max_perf(100.0, 0.0) == 100.0 * MIN_SHARE  # each request still loads what it needs
