"""The prepared snapshot round-trips every weight format bit-exactly, detects damage and loads in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import pytest

from engine.checkpoint.loader import load_weights
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version, load_prepared, save_prepared
from engine.config import ModelConfig
from engine.checkpoint.prepared_store import (ALIGN, PLAN_NAME, PreparedSnapshotError, check_prepared, invalidate_prepared,
                                              read_plan)


def buffers(weight):
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [v for v in vars(weight).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct", "nvfp4-modelopt"])
def test_round_trip_is_exact(tiny_dir, tmp_path, fmt):
    snapshot = tiny_dir(fmt)
    weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    plan = save_prepared(weights, tmp_path / "prepared")
    assert list(plan.files)[0] == "dense.bin" and all(r.offset % ALIGN == 0 for r in plan.regions)
    assert check_prepared(tmp_path / "prepared", FORMAT_VERSION, engine_version()) == []
    loaded, stats = load_prepared(tmp_path / "prepared", workers=4)
    assert stats.bytes == sum(r.size for r in plan.regions)
    assert loaded.keys() == weights.keys()
    for name, weight in weights.items():
        assert type(loaded[name]) is type(weight), name
        for a, b in zip(buffers(loaded[name]), buffers(weight)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_damage_and_version_changes_are_reported(tiny_dir, tmp_path):
    snapshot = tiny_dir("nvfp4-ct")
    save_prepared(load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16), tmp_path)
    plan = read_plan(tmp_path)
    region = next(r for r in plan.regions if r.file.startswith("experts"))
    path = tmp_path / region.file
    data = bytearray(path.read_bytes())
    data[region.offset + 5] ^= 0x10  # one flipped bit, same size: only the hash can tell
    path.write_bytes(bytes(data))
    assert check_prepared(tmp_path, FORMAT_VERSION, engine_version()) == []
    with pytest.raises(PreparedSnapshotError, match=f"checksum mismatch in {region.key}"):
        load_prepared(tmp_path)
    assert "this is 9.9" in check_prepared(tmp_path, FORMAT_VERSION, "9.9")[0]
    path.write_bytes(bytes(data[:-100]))
    assert any(region.file in p and "bytes" in p for p in check_prepared(tmp_path, FORMAT_VERSION, engine_version()))


def test_an_invalidated_snapshot_is_not_trusted_but_still_readable(tiny_dir, tmp_path):
    """What a partial load does with a piece found damaged while it is still reading the others."""
    from engine.checkpoint.prepared_store import read_regions

    snapshot = tiny_dir("bf16")
    weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    plan = save_prepared(weights, tmp_path)
    assert invalidate_prepared(tmp_path) and not invalidate_prepared(tmp_path)
    assert check_prepared(tmp_path, FORMAT_VERSION, engine_version()) == [f"{tmp_path / PLAN_NAME}: missing"]
    assert read_regions(tmp_path, plan, workers=2, destinations={
        r.key: memoryview(bytearray(r.size)) for r in plan.regions}).bytes == sum(r.size for r in plan.regions)


def test_staged_reads_hand_every_piece_to_the_sink(tiny_dir, tmp_path, monkeypatch):
    """The GPU path's reading mode (small reused staging buffers + a sink), checked on host memory."""
    import engine.checkpoint.prepared_store as store
    from engine.checkpoint.prepared import allocate, as_bytes
    from engine.checkpoint.prepared_store import read_regions

    monkeypatch.setattr(store, "PIECE_BYTES", 4096)  # many pieces per region, buffers reused many times
    snapshot = tiny_dir("fp8")
    weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    save_prepared(weights, tmp_path)
    plan = read_plan(tmp_path)
    _, direct = allocate(plan.meta)
    read_regions(tmp_path, plan, {k: as_bytes(t) for k, (t,) in direct.items()}, workers=3)
    _, staged = allocate(plan.meta)
    flat = {k: t.view(torch.uint8).reshape(-1) for k, (t,) in staged.items()}

    def sink(key, offset, piece):
        flat[key][offset:offset + len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8))

    buffers = [as_bytes(torch.empty(4096, dtype=torch.uint8)) for _ in range(3)]
    read_regions(tmp_path, plan, None, workers=3, sink=sink, staging=buffers)
    for key, (tensor,) in direct.items():
        assert torch.equal(flat[key], tensor.view(torch.uint8).reshape(-1)), key


def test_experts_can_be_placed_apart_from_the_rest(tiny_dir, tmp_path):
    """Under an expert budget both loaders put each MoE layer's first experts on the device and the others
    in host RAM; the meta device stands in for the GPU here (it holds no data, but is a device of its own)."""
    from engine.checkpoint.layout import is_expert_stack
    from engine.checkpoint.prepared import allocate
    from engine.memory_plan import HOST_SPARES
    from engine.weights import SplitStack

    snapshot = tiny_dir("nvfp4-ct")
    cfg = ModelConfig.from_dir(snapshot)
    weights = load_weights(snapshot, cfg, "meta", torch.bfloat16, expert_slots=2)
    save_prepared(load_weights(snapshot, cfg, "cpu", torch.bfloat16), tmp_path)
    allocated, _ = allocate(read_plan(tmp_path).meta, "meta", expert_slots=2)
    for loaded in (weights, allocated):
        experts = {n for n in loaded if is_expert_stack(n)}
        assert len(experts) == 3 * len(cfg.moe_layers)
        for name, weight in loaded.items():
            if name not in experts:
                assert {t.device.type for t in buffers(weight)} == {"meta"}, name
                continue
            assert isinstance(weight, SplitStack) and weight.shape[0] == cfg.n_routed_experts
            assert {t.device.type for t in buffers(weight.device)} == {"meta"}
            assert {t.device.type for t in buffers(weight.host)} == {"cpu"}
            assert weight.device.shape[0] == 2 and weight.hosted.shape[0] == cfg.n_routed_experts - 2
            assert weight.host.shape[0] == weight.hosted.shape[0] + HOST_SPARES  # room for swaps, in the bank


def test_split_experts_hold_the_same_bytes_as_whole_stacks(tiny_dir, tmp_path):
    """Loading split (from the checkpoint or the prepared snapshot) puts every expert's bytes where the
    split says, and a snapshot prepared from split weights holds the bytes of the one from whole stacks."""
    from engine.checkpoint.layout import is_expert_stack

    snapshot = tiny_dir("fp8")
    cfg = ModelConfig.from_dir(snapshot)
    whole = load_weights(snapshot, cfg, "cpu", torch.bfloat16)
    split = load_weights(snapshot, cfg, "cpu", torch.bfloat16, expert_slots=3)
    save_prepared(whole, tmp_path / "whole")
    save_prepared(split, tmp_path / "split")
    from_whole, _ = load_prepared(tmp_path / "whole")
    from_split, _ = load_prepared(tmp_path / "split")
    assert from_whole.keys() == from_split.keys()
    for name, weight in from_whole.items():
        assert all(torch.equal(a, b) for a, b in zip(buffers(weight), buffers(from_split[name]))), name
    resumed, _ = load_prepared(tmp_path / "whole", expert_slots=3)
    for loaded in (split, resumed):
        for name, weight in whole.items():
            if not is_expert_stack(name):
                continue
            for field in ("data", "scale_inv"):
                full = getattr(weight, field)
                assert torch.equal(getattr(loaded[name].device, field), full[:3]), name
                assert torch.equal(getattr(loaded[name].hosted, field), full[3:]), name


def test_pieces_lent_staging_buffers_round_trip(tmp_path, monkeypatch):
    """The GPU path's writing mode (each piece copied into a lent staging buffer before it is hashed and
    written), checked with host buffers: many pieces per region, buffers reused many times."""
    import threading

    import engine.checkpoint.prepared_store as store
    from engine.checkpoint.prepared_store import read_regions, write_prepared

    monkeypatch.setattr(store, "PIECE_BYTES", 4096)
    data = {f"r{i}": torch.randint(0, 256, (n,), dtype=torch.uint8) for i, n in enumerate((10_000, 1, 4096, 0, 70_001))}
    lent = [torch.empty(4096, dtype=torch.uint8) for _ in range(3)]
    users: set[int] = set()

    def piece(key, start, size, buffer):
        assert buffer is not None and size <= 4096
        users.add(id(buffer))
        buffer[:size].copy_(data[key][start:start + size])
        return memoryview(buffer[:size].numpy())

    files = [("a.bin", [("r0", 10_000), ("r1", 1)]), ("b.bin", [("r2", 4096), ("r3", 0), ("r4", 70_001)])]
    plan = write_prepared(tmp_path / "p", files, piece, 1, "v", {}, workers=3, staging=lent, stop=threading.Event())
    assert users == {id(b) for b in lent} and not (tmp_path / "p.partial").exists()
    assert check_prepared(tmp_path / "p", 1, "v") == []
    back = {k: bytearray(len(v)) for k, v in data.items()}
    read_regions(tmp_path / "p", plan, {k: memoryview(b) for k, b in back.items()}, workers=2)
    assert all(bytes(back[k]) == v.numpy().tobytes() for k, v in data.items())


FILES = [("dense.bin", [(f"k{i}", 100_000) for i in range(20)])]


def piece_bytes(key: str, start: int, size: int) -> bytes:
    """Bytes of a piece that depend on its region and place (a resumed write must put each where it was)."""
    seed = int(key[1:]) * 7919 + start
    return bytes((seed + i) % 251 for i in range(size))


def recording_source(asked: list[str], stop=None, stop_after: int = 0):
    def piece(key, start, size, buffer):
        asked.append(key)
        if stop is not None and len(asked) == stop_after:
            stop.set()
        return memoryview(piece_bytes(key, start, size))
    return piece


def assert_whole(directory: Path) -> None:
    """The snapshot validates and every region reads back as written."""
    from engine.checkpoint.prepared_store import read_regions

    assert check_prepared(directory, FORMAT_VERSION, engine_version()) == []
    plan = read_plan(directory)
    back = {r.key: bytearray(r.size) for r in plan.regions}
    read_regions(directory, plan, {k: memoryview(b) for k, b in back.items()}, workers=2)
    assert all(bytes(back[r.key]) == piece_bytes(r.key, 0, r.size) for r in plan.regions)


def test_a_stopped_write_leaves_nothing_trusted_and_the_next_resumes_it(tmp_path):
    """A write asked to stop keeps its partial files and journal, which no start trusts; the next write of the
    same layout asks only for the pieces not on disk yet and ends whole; one of another layout starts over."""
    import threading

    from engine.checkpoint.prepared_store import partial_dir, write_prepared

    stop, asked = threading.Event(), []
    with pytest.raises(PreparedSnapshotError, match="writing stopped"):
        write_prepared(tmp_path / "p", FILES, recording_source(asked, stop, 3), FORMAT_VERSION, engine_version(),
                       {}, workers=1, stop=stop)
    assert asked == ["k0", "k1", "k2"] and not (tmp_path / "p").exists() and partial_dir(tmp_path / "p").is_dir()
    assert check_prepared(tmp_path / "p", FORMAT_VERSION, engine_version()) != []

    again: list[str] = []
    write_prepared(tmp_path / "p", FILES, recording_source(again), FORMAT_VERSION, engine_version(), {}, workers=2)
    assert sorted(again) == sorted(f"k{i}" for i in range(3, 20)) and not partial_dir(tmp_path / "p").exists()
    assert_whole(tmp_path / "p")

    stop, asked = threading.Event(), []
    with pytest.raises(PreparedSnapshotError, match="writing stopped"):
        write_prepared(tmp_path / "q", FILES, recording_source(asked, stop, 3), FORMAT_VERSION, engine_version(),
                       {"source": "a"}, workers=1, stop=stop)
    other: list[str] = []
    write_prepared(tmp_path / "q", FILES, recording_source(other), FORMAT_VERSION, engine_version(),
                   {"source": "b"}, workers=2)
    assert len(other) == 20
    assert_whole(tmp_path / "q")


def test_a_cold_start_keeps_only_a_partial_write_it_can_resume(tmp_path):
    """`discard_prepared` removes the snapshot, and the partial write unless its meta passes `keep_partial` (the
    provisioning layer's check: the same source)."""
    import threading

    from engine.checkpoint.prepared_store import discard_prepared, partial_dir, write_prepared

    for source, kept in (("a", True), ("b", False)):
        directory, stop = tmp_path / source, threading.Event()
        with pytest.raises(PreparedSnapshotError, match="writing stopped"):
            write_prepared(directory, FILES, recording_source([], stop, 2), FORMAT_VERSION, engine_version(),
                           {"source": source}, workers=1, stop=stop)
        discard_prepared(directory, keep_partial=lambda meta: meta.get("source") == "a")
        assert partial_dir(directory).is_dir() == kept


def test_a_failed_write_leaves_no_partial_and_the_old_snapshot_until_a_new_one_is_whole(tiny_dir, tmp_path):
    """A write that fails (no space) removes its partial files; a complete older snapshot at the same place is
    only replaced once the new one is whole."""
    import engine.checkpoint.prepared_store as store
    from engine.checkpoint.prepared_store import partial_dir, write_prepared

    snapshot = tiny_dir("nvfp4-ct")
    weights = load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.bfloat16)
    save_prepared(weights, tmp_path / "p")
    before = read_plan(tmp_path / "p")

    def failing(key, start, size, buffer):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_prepared(tmp_path / "p", FILES, failing, FORMAT_VERSION, engine_version(), {}, workers=2)
    assert read_plan(tmp_path / "p") == before and not partial_dir(tmp_path / "p").exists()
    assert check_prepared(tmp_path / "p", FORMAT_VERSION, engine_version()) == []
    assert store.PLAN_NAME in {p.name for p in (tmp_path / "p").iterdir()}


KILLED_WRITE = """
import sys, time
from pathlib import Path
from engine.checkpoint.prepared import FORMAT_VERSION, engine_version
import engine.checkpoint.prepared_store as store
from tests.engine.checkpoint.test_prepared import FILES, piece_bytes
store.JOURNAL_EVERY_S = 0.05
def slow(key, start, size, buffer):
    time.sleep(0.2)
    return memoryview(piece_bytes(key, start, size))
store.write_prepared(Path(sys.argv[1]), FILES, slow, FORMAT_VERSION, engine_version(), {}, workers=2)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL of a child process")
def test_a_write_killed_mid_way_validates_nowhere_and_resumes_from_its_journal(tmp_path):
    """kill -9 while pieces are being written: nothing at the snapshot's place validates; the journal (a line
    cut short by the kill included) lets the next write resume, and the snapshot it ends with is whole."""
    import signal
    import time

    from engine.checkpoint.prepared_store import JOURNAL_NAME, partial_dir, write_prepared

    directory = tmp_path / "p"
    journal = partial_dir(directory) / JOURNAL_NAME
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITE, str(directory)],
                             cwd=Path(__file__).parents[3])
    deadline = time.monotonic() + 60
    while not (journal.is_file() and journal.read_text().count("\n") >= 4):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert check_prepared(directory, FORMAT_VERSION, engine_version()) != []
    on_disk = journal.read_text().count("\n")
    assert 4 <= on_disk < 20
    with open(journal, "a") as f:
        f.write("k19@0 0bad")  # a line the kill cut short
    asked: list[str] = []
    write_prepared(directory, FILES, recording_source(asked), FORMAT_VERSION, engine_version(), {}, workers=2)
    assert len(asked) == 20 - on_disk and "k19" in asked
    assert_whole(directory)


LOAD_MEMORY_SCRIPT = """
import json, os, sys, threading, time
from pathlib import Path
import torch
from engine.checkpoint.prepared import load_prepared
from engine.weights import SplitStack
device = torch.device(sys.argv[2])
if device.type == "cuda":  # the context's own host memory comes before the measurement
    torch.zeros(1, device=device)
resident = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
peak, loading = [0], [True]
def watch():  # the load's own peak (the process's, ru_maxrss, includes the imports' transients)
    while loading[0]:
        peak[0] = max(peak[0], resident())
        time.sleep(0.0005)
watcher = threading.Thread(target=watch)
before = resident()
watcher.start()
weights, stats = load_prepared(Path(sys.argv[1]), device, workers=2, expert_slots=4)
loading[0] = False
watcher.join()
host_bank = sum(w.host.nbytes() for w in weights.values() if isinstance(w, SplitStack))
print(json.dumps({"before": before, "peak": max(peak[0], resident()), "bytes": stats.bytes, "host_bank": host_bank}))
"""


def load_memory(tmp_path: Path, device: str) -> dict:
    """A prepared snapshot of ~270 MB of bf16 experts (above the process's noise) loaded in a fresh process on
    `device`, experts split 4 slots / the host bank: its host memory before, its peak while loading, the bytes
    read and the host bank's (spares included)."""
    from engine.tiny.factory import synthetic_weights, tiny_config

    text = {"n_routed_experts": 64, "moe_intermediate_size": 512}
    cfg = ModelConfig.from_dict({"text_config": tiny_config("bf16", **text)["text_config"]})
    save_prepared(synthetic_weights(cfg, "bf16", "cpu", torch.bfloat16), tmp_path / "prepared", workers=2)
    run = subprocess.run([sys.executable, "-c", LOAD_MEMORY_SCRIPT, str(tmp_path / "prepared"), device],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[3])
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's memory from /proc (Linux)")
def test_a_load_holds_its_weights_and_little_else(tmp_path):
    """Host RAM of a load with experts split between slots and the host bank: each piece is read in place
    (on the CPU) into its final buffer, so the process's peak grows by the snapshot's bytes and a small margin,
    not by a second copy of any file or stack (measured in a fresh process, sampled while it loads)."""
    figures = load_memory(tmp_path, "cpu")
    grown, nbytes = figures["peak"] - figures["before"], figures["bytes"]
    assert nbytes > 250e6
    assert 0.9 * nbytes <= grown <= nbytes + (64 << 20), figures


@pytest.mark.parametrize("fmt, placed", [("nvfp4-ct", False), ("fp8", True)])
def test_the_mtp_layers_experts_are_split_only_where_stored_as_the_others(tiny_dir, tmp_path, fmt, placed):
    """The NVFP4 releases store the MTP layer's experts in FP8 blocks, a format hybrid offload does not share with
    the decoder layers': under a split they stay whole on the device, from the checkpoint and from the prepared
    snapshot, and the sizes the memory plan reads count them as the device's bytes. The FP8 release's MTP experts
    are split and placed like any layer's."""
    from engine.checkpoint.layout import stacked_expert_name
    from engine.checkpoint.loader import checkpoint_sizes
    from engine.checkpoint.prepared import prepared_sizes
    from engine.weights import SplitStack

    snapshot = tiny_dir(fmt, num_nextn_predict_layers=1)
    cfg = ModelConfig.from_dir(snapshot)
    split = load_weights(snapshot, cfg, "cpu", torch.bfloat16, expert_slots=3, mtp=True)
    save_prepared(split, tmp_path / "prepared")
    resumed, _ = load_prepared(tmp_path / "prepared", expert_slots=3)
    for loaded in (split, resumed):
        assert isinstance(loaded[stacked_expert_name(cfg.moe_layers[0], "gate_proj")], SplitStack)
        assert isinstance(loaded[stacked_expert_name(cfg.num_layers, "gate_proj")], SplitStack) is placed
    with_mtp, without = checkpoint_sizes(snapshot, cfg, mtp=True), checkpoint_sizes(snapshot, cfg)
    mtp_experts = sum(t.numel() * t.element_size() for name, stack in split.items()
                      if name.startswith(f"layers.{cfg.num_layers}.mlp.experts.")
                      for t in buffers(stack.device) + buffers(stack.hosted) if isinstance(stack, SplitStack)) \
        if placed else 0
    assert with_mtp.expert_layers == len(cfg.moe_layers) + placed and without.expert_layers == len(cfg.moe_layers)
    assert with_mtp.experts == without.experts + mtp_experts
    assert with_mtp.total > without.total  # the MTP layer is loaded, whole or split
    prepared = prepared_sizes(read_plan(tmp_path / "prepared").meta)
    assert (prepared.experts, prepared.expert_layers) == (with_mtp.experts, with_mtp.expert_layers)
