"""Early readiness in the engine: steps run before the routed experts are all loaded, the experts they need
are brought in first, and greedy tokens match the fully loaded engine's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.checkpoint.availability import ExpertAvailability, ExpertUnit
from engine.checkpoint.loader import load_weights, open_weights
from engine.checkpoint.prepared import load_prepared, open_prepared, save_prepared
from engine.checkpoint.prepared_store import PreparedSnapshotError, read_plan
from engine.config import ModelConfig
from engine.engine_core import EngineCore, EngineOptions
from engine.experts.filling import FillingExperts
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine.conftest import run_together

PROMPTS = [[258, 260, 263, 72, 105], [258, 260, 263, 79, 107, 33]]
# More experts than the steps below can route to (2 x 19 tokens per layer at most), so some are left to the fill.
EXPERTS = dict(n_routed_experts=64, num_experts_per_tok=2)


def greedy(core: EngineCore, max_tokens: int = 4) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    return [seq.output_token_ids for seq in run_together(core, seqs)]


def options(budget: int | None) -> EngineOptions:
    return EngineOptions(max_num_seqs=4, max_model_len=256, moe_vram_budget=budget, prefix_cache=False)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-ct"])
@pytest.mark.parametrize("slots", [None, 3])  # every expert resident, or hybrid (3 device slots per layer)
def test_partial_engine_serves_before_the_fill_with_the_same_tokens(tiny_dir, fmt, slots):
    snapshot = tiny_dir(fmt, **EXPERTS)
    cfg = ModelConfig.from_dir(snapshot)
    budget = None if slots is None else 0  # a budget makes the engine hybrid; the loader's split decides slots
    full = EngineCore(cfg, load_weights(snapshot, cfg, "cpu", torch.float32, slots), options(budget))
    weights, experts = open_weights(snapshot, cfg, "cpu", torch.float32, slots)
    partial = EngineCore(cfg, weights, options(budget), experts=experts)
    assert isinstance(partial.expert_fill, FillingExperts) and experts.share == 0.0
    hybrid = partial.offload
    assert hybrid is None or not hybrid.prefetch_banks  # no bank copied ahead of its turn while the fill writes

    assert greedy(partial) == greedy(full)
    assert 0.0 < experts.share < 1.0 and not experts.complete  # only what the steps needed was read
    assert experts.on_demand_units > 0

    experts.fill(workers=2)
    assert experts.complete and experts.share == 1.0
    assert greedy(partial) == greedy(full)
    assert partial.expert_fill is None  # dropped between steps once complete
    assert hybrid is None or hybrid.prefetch_banks
    assert all(layer.mlp.experts is (partial.offload or layer.mlp.experts) for layer in partial.model.layers
               if hasattr(layer.mlp, "experts"))


@pytest.mark.parametrize("slots", [None, 3])
def test_partial_engine_from_a_prepared_snapshot(tiny_dir, tmp_path, slots):
    """The fast_resume path: non-expert regions read first, expert pieces on demand or by the fill."""
    snapshot = tiny_dir("nvfp4-ct", **EXPERTS)
    cfg = ModelConfig.from_dir(snapshot)
    save_prepared(load_weights(snapshot, cfg, "cpu", torch.float32), tmp_path / "prepared", workers=2)
    budget = None if slots is None else 0
    full = EngineCore(cfg, load_prepared(tmp_path / "prepared", expert_slots=slots)[0], options(budget))
    weights, stats, experts = open_prepared(tmp_path / "prepared", workers=2, expert_slots=slots)
    assert 0 < stats.bytes < sum(p.stat().st_size for p in (tmp_path / "prepared").glob("*.bin"))
    partial = EngineCore(cfg, weights, options(budget), experts=experts)
    assert greedy(partial) == greedy(full) and experts.on_demand_units > 0
    experts.fill(workers=2)
    assert experts.complete and greedy(partial) == greedy(full) and partial.expert_fill is None


def test_a_damaged_expert_piece_is_handed_to_on_damaged_by_whoever_reads_it(tiny_dir, tmp_path):
    """Found by the fill or by a step's on-demand read alike, naming the file and the piece, before it fails them."""
    snapshot = tiny_dir("nvfp4-ct", **EXPERTS)
    save_prepared(load_weights(snapshot, ModelConfig.from_dir(snapshot), "cpu", torch.float32), tmp_path, workers=2)
    region = read_plan(tmp_path).regions[-1]  # the last MoE layer's last expert buffer, one piece here
    with open(tmp_path / region.file, "r+b") as f:
        f.seek(region.offset + region.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    found: list[PreparedSnapshotError] = []
    _, _, experts = open_prepared(tmp_path, workers=2, on_damaged=found.append)
    with pytest.raises(PreparedSnapshotError, match=f"checksum mismatch in {region.key}@0"):
        experts.fill(workers=2)
    assert [(e.file, e.piece) for e in found] == [(tmp_path / region.file, f"{region.key}@0")]
    assert not experts.complete  # every sound piece is in, this one is not
    layer = int(region.key.split(".")[1])
    with pytest.raises(PreparedSnapshotError):
        experts.ensure(layer, [0])
    assert len(found) == 2 and not experts.loaded[layer][0]


def test_a_unit_loading_in_the_fill_is_waited_for_not_read_twice():
    """An on-demand load of an expert the fill is loading at that moment waits for it: one read, then usable."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> None:
        calls.append("slow")
        started.set()
        assert release.wait(10)

    units = [ExpertUnit(slow, ((1, 0), (1, 1)), 10), ExpertUnit(lambda: calls.append("other"), ((1, 1),), 5)]
    availability = ExpertAvailability(units, [1], 2)
    filler = threading.Thread(target=availability.fill)
    filler.start()
    assert started.wait(10)
    waiter = threading.Thread(target=availability.ensure, args=(1, [0]))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not availability.loaded[1][0]  # waiting on the fill's read, not reading itself
    release.set()
    waiter.join(10)
    filler.join(10)
    assert calls == ["slow", "other"] and availability.complete and availability.share == 1.0
    assert availability.loaded[1].tolist() == [True, True]


def test_a_failed_unit_is_retried_by_the_next_caller():
    attempts = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk went away")

    availability = ExpertAvailability([ExpertUnit(flaky, ((1, 0),), 1)], [1], 1)
    with pytest.raises(OSError):
        availability.ensure(1, [0])
    availability.ensure(1, [0])
    assert availability.complete and len(attempts) == 2


def test_the_fill_rate_cap_paces_the_reads():
    units = [ExpertUnit(lambda: None, ((1, e),), 1000) for e in range(4)]
    availability = ExpertAvailability(units, [1], 4)
    start = time.perf_counter()
    availability.fill(workers=2, gb_per_s=1e-5)  # 10 kB/s: the 4th unit is due after 0.3 s
    assert time.perf_counter() - start >= 0.29 and availability.complete


def test_allocating_the_expert_stacks_imports_no_compiler(tiny_dir):
    """The stacks' layout comes from converting one expert on the meta device; NVFP4 compressed-tensors'
    global-scale reciprocal there imported torch's compiler (3.5 s of a 2-vCPU start, before any expert read).
    In a process of its own: this one may have imported it already."""
    import subprocess
    import sys

    from tests.child_env import child_env

    code = ("import sys, torch\nfrom engine.config import ModelConfig\n"
            "from engine.checkpoint.loader import open_weights\n"
            f"d = {str(tiny_dir('nvfp4-ct'))!r}\nopen_weights(d, ModelConfig.from_dir(d), 'cpu', torch.float32)\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_a_steps_missing_experts_load_several_at_once():
    """The units one step needs are read in parallel (one after another, a short prompt's first layer waited
    seconds); each still once, and the on-demand threads end once every expert is in."""
    running, most, lock = [0], [0], threading.Lock()

    def slow() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1

    units = [ExpertUnit(slow, ((1, e),), 10) for e in range(8)]
    availability = ExpertAvailability(units, [1], 8)
    start = time.perf_counter()
    availability.ensure(1, range(8))
    assert time.perf_counter() - start < 0.2 * 8 / 2 and most[0] > 1
    assert availability.complete and availability.on_demand_units == 8 and availability._on_demand is None
    availability.ensure(1, range(8))  # all in: nothing read again
    assert availability.on_demand_units == 8
