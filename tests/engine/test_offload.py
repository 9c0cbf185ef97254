"""Hybrid offload on CPU: placement, the hybrid executor against the all-resident reference, swaps."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from engine.quant import FP8_BLOCK, quantize_fp8_block, quantize_nvfp4
from engine.experts.hybrid import HybridExperts, expert_nbytes
from engine.experts.torch_experts import TorchExperts
from engine.offload.placement import hottest, plan_placement, slots_per_layer
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight, tensor_fields
from tests.cpu_kernels import assert_expert_close

E, D, I, LIMIT = 12, 128, 64, 7.0


def stack(fmt: str, n: int, k: int, seed: int):
    w = torch.randn(E, n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    if fmt == "dense":
        return DenseWeight(w)
    if fmt == "fp8":
        parts = [quantize_fp8_block(w[e], FP8_BLOCK) for e in range(E)]
        return Fp8BlockWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    parts = [quantize_nvfp4(w[e]) for e in range(E)]
    return Nvfp4Weight(*(torch.stack([p[i] for p in parts]) for i in range(3)))


def layer_stacks(fmt: str, seed: int, inter: int = I):
    return stack(fmt, inter, D, seed), stack(fmt, inter, D, seed + 1), stack(fmt, D, inter, seed + 2)


def routed(t: int, k: int, seed: int, only: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)
    pool = torch.tensor(only) if only is not None else torch.arange(E)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=g)


# bf16 against the float32 reference on the same rounded inputs, in units of bf16's rounding (2^-8): measured at
# most 1.9 units over a whole output and 2.8 in its worst row (the reference executor's own error in bf16, which
# rounds each expert's share); allowed 4 (torch.testing's rtol for bf16) and 8. A pair dropped or run twice moves
# its row by its share of the row, 6% or more here for every pair weighted 0.1 or more; a lost share of the
# misses or a miss also run on the device, 60% or more of the output.
BF16_ROUNDING = 2.0 ** -8
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def assert_routed_close(got: torch.Tensor, want: torch.Tensor, fmt: str, dtype: torch.dtype) -> None:
    """A routed sum computed from inputs in `dtype` against the float32 reference on the same (rounded) inputs:
    in float32 within the CPU kernels' own bound; in bf16 (the output rounded once, the device's experts
    computed in bf16) within 4 roundings of the whole output's norm and 8 of each row's."""
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_expert_close(got, want, fmt)
        return
    diff, want = got.double() - want.double(), want.double()
    whole, worst = float(diff.norm() / want.norm()), float((diff.norm(dim=-1) / want.norm(dim=-1)).max())
    assert whole < 4 * BF16_ROUNDING and worst < 8 * BF16_ROUNDING, \
        f"relative error {whole:.2e}, {worst:.2e} in the worst row ({dtype})"


def test_slots_split_the_budget_evenly_over_layers():
    assert slots_per_layer(10 * 100 * 3, 100, 3, 288) == 10
    assert slots_per_layer(10 ** 12, 100, 3, 288) == 288  # never more slots than experts
    assert slots_per_layer(0, 100, 3, 288) == 0
    with pytest.raises(ValueError, match="budget"):
        slots_per_layer(-1, 100, 3, 288)


def test_hottest_experts_take_the_slots():
    counts = torch.tensor([0.0, 5.0, 1.0, 5.0, 9.0])
    assert hottest(counts, 5, 3) == [1, 3, 4]
    assert hottest(counts, 5, 2) == [1, 4]  # 1 and 3 tie: the lower id
    assert hottest(None, 5, 2) == [0, 1]
    plan = plan_placement([3, 5], 5, 10, 2 * 2 * 10, {5: counts})
    assert plan == {3: [0, 1], 5: [1, 4]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
@pytest.mark.parametrize("resident", [[], [0, 3, 7], list(range(E))])
def test_hybrid_equals_all_resident(fmt, resident, dtype):
    stacks = {1: layer_stacks(fmt, 1), 4: layer_stacks(fmt, 7)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = HybridExperts.place(stacks, {1: resident, 4: resident}, torch.device("cpu"), LIMIT)
    for layer in (1, 4):
        # decode, ragged batch, top-1, past a decode-sized batch (the CPU's eager pass) but short of a fetch
        for t, k, seed in [(1, 4, 0), (9, 4, 1), (5, 1, 2), (40, 4, 3)]:
            x, ids, w = routed(t, k, seed)
            x = x.to(dtype)
            assert_routed_close(hybrid(layer, x, ids, w), reference(layer, x.float(), ids, w), fmt, dtype)
    stats = hybrid.stats
    assert stats.device_pairs + stats.host_pairs == 2 * (4 + 36 + 5 + 160)
    assert (stats.host_pairs == 0) == (resident == list(range(E)))


def test_all_hits_touch_no_host_expert():
    stacks = {0: layer_stacks("dense", 3)}
    hybrid = HybridExperts.place(stacks, {0: [2, 5, 6, 9]}, torch.device("cpu"), LIMIT)
    x, ids, w = routed(6, 3, 4, only=[2, 5, 6, 9])
    assert_expert_close(hybrid(0, x, ids, w), TorchExperts(stacks, LIMIT)(0, x, ids, w), "dense")
    assert hybrid.stats.host_pairs == 0 and hybrid.stats.hit_rate == 1.0


def placed(hybrid: HybridExperts, layer: int) -> list[int]:
    """Every expert of the layer where it is placed, slots then host entries (spare entries left out)."""
    return sorted(hybrid.resident[layer] + [e for e in hybrid.hosted[layer] if e is not None])


def test_rebalance_moves_hot_experts_in_and_keeps_outputs():
    """A move runs while steps go on: it takes effect at the next call, one at a time per spare host entry, and
    every step in between reads each expert where it is, with the same outputs."""
    stacks = {0: layer_stacks("nvfp4", 5)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = HybridExperts.place(stacks, {0: [0, 1, 2]}, torch.device("cpu"), LIMIT)
    x, ids, w = routed(8, 2, 6, only=[8, 9, 10, 11])
    for _ in range(3):  # counts well above noise: ~12 each against none
        hybrid(0, x, ids, w)
    assert hybrid.stats.hit_rate == 0.0
    assert hybrid.rebalance(max_swaps=2) == 1  # bounded by the layer's one spare host entry
    assert hybrid.resident[0] == [0, 1, 2] and hybrid.stats.swaps == 0  # under way: nothing moved yet
    assert_expert_close(hybrid(0, x, ids, w), reference(0, x, ids, w), "nvfp4")
    assert hybrid.rebalance(max_swaps=5) == 1 and hybrid.stats.swaps == 1  # committed, the next one started
    assert len(set(hybrid.resident[0]) & {8, 9, 10, 11}) == 1
    assert_expert_close(hybrid(0, x, ids, w), reference(0, x, ids, w), "nvfp4")
    assert hybrid.rebalance(max_swaps=5) == 1
    assert hybrid.rebalance(max_swaps=5) == 0  # three slots: the three hottest of 8..11; nothing else to move
    assert len(set(hybrid.resident[0]) & {8, 9, 10, 11}) == 3 and hybrid.stats.swaps == 3
    assert placed(hybrid, 0) == list(range(E))  # each expert in one place only
    assert hybrid.hosted[0].count(None) == 1
    assert_expert_close(hybrid(0, x, ids, w), reference(0, x, ids, w), "nvfp4")
    assert hybrid.stats.device_pairs > 0


def with_device_maps_of_their_own(hybrid: HybridExperts) -> HybridExperts:
    """The expert -> slot and expert -> host entry maps the device's kernels read are copies of the host's on a
    GPU, refreshed by every commit; on the CPU `.to(device)` hands back the same tensor, so a commit that left
    them stale would go unseen. Here they get storage of their own, as on a GPU."""
    assert {"slot_of", "_slot_of_host", "entry_of", "entry_on_device"} <= vars(hybrid).keys()  # still those maps
    hybrid._slot_of_host = hybrid.slot_of.clone()
    hybrid.entry_on_device = hybrid.entry_of.clone()
    return hybrid


def test_swaps_with_the_pcie_share_on_keep_outputs():
    """The PCIe share looks up each missed expert's host entry in the device's entry map: after a swap the
    outgoing expert sits in a spare entry, and a map left stale stages nothing for it (the staging slot's last
    expert runs in its place). After each commit, rows routed to the swapped experts (the outgoing one first
    in each row, where the link's share takes it; the incoming one now a hit) equal the reference."""
    stacks = {0: layer_stacks("fp8", 5)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = with_device_maps_of_their_own(HybridExperts.place(stacks, {0: [0, 1, 2]}, torch.device("cpu"), LIMIT,
                                                               fetch_capacity=4, pcie_percent=50))
    x, ids, w = routed(8, 2, 6, only=[8, 9, 10, 11])
    for _ in range(3):  # counts well above noise (as in the test above), steps on the link and the CPU
        assert_expert_close(hybrid(0, x, ids, w), reference(0, x, ids, w), "fp8")
    assert hybrid.rebalance(max_swaps=1) == 1
    for swaps in range(1, 4):
        hybrid.rebalance(max_swaps=1)  # commits the move under way, starts the next
        assert hybrid.stats.swaps == swaps
        outgoing = [e for e in (0, 1, 2) if e not in hybrid.resident[0]]
        incoming = [e for e in hybrid.resident[0] if e not in (0, 1, 2)]
        cold = next(e for e in range(3, 8) if e not in hybrid.resident[0])  # never moved, always a miss
        rows = torch.tensor([[outgoing[r % swaps], incoming[r % swaps], cold] for r in range(3)])
        x2, _, w2 = routed(3, 3, 20 + swaps)
        fetched = hybrid.stats.fetched_pairs
        assert_expert_close(hybrid(0, x2, rows, w2), reference(0, x2, rows, w2), "fp8")
        assert hybrid.stats.fetched_pairs - fetched == 3  # half of the six misses: two of them outgoing experts
    assert len(set(hybrid.resident[0]) & {8, 9, 10, 11}) == 3 and placed(hybrid, 0) == list(range(E))


def test_rebalance_needs_a_margin_and_takes_the_hottest_first():
    """An outside expert routed only a little more than a resident stays outside (counts near the cut trade
    places all the time); well above the margin it moves in, the hottest outside one for the coldest resident."""
    from engine.experts.hybrid import SWAP_MARGIN

    stacks = {0: layer_stacks("nvfp4", 5), 3: layer_stacks("nvfp4", 6)}
    hybrid = HybridExperts.place(stacks, {0: [0, 1, 2], 3: [0, 1, 2]}, torch.device("cpu"), LIMIT)
    hybrid.decay = 1.0
    counts = torch.zeros(2, E)
    counts[:, :3] = torch.tensor([1000.0, 400.0, 800.0])
    counts[0, 5] = 400.0 * SWAP_MARGIN  # ties the margin: not enough
    counts[1, 7], counts[1, 6] = 400.0 * SWAP_MARGIN + 50, 400.0 * SWAP_MARGIN + 25
    hybrid.counts.copy_(counts)
    assert hybrid.rebalance(max_swaps=4) == 1
    assert hybrid.rebalance(max_swaps=4) == 0  # the first move committed; the three hottest are resident
    assert hybrid.resident[0] == [0, 1, 2] and sorted(hybrid.resident[3]) == [0, 2, 7]
    assert placed(hybrid, 3) == list(range(E))


def test_a_swap_needs_more_than_noise_and_the_largest_gain_goes_first():
    """Counts of routing events vary by about their square root: an outside expert routed 6 times against a
    resident's 2 is noise under uniform routing (SWAP_Z standard deviations not reached), 60 against 20 is not.
    Bounded to one move, the layer that gains most moves first."""
    from engine.experts.hybrid import SWAP_Z

    stacks = {0: layer_stacks("dense", 5), 3: layer_stacks("dense", 6)}
    hybrid = HybridExperts.place(stacks, {0: [0, 1, 2], 3: [0, 1, 2]}, torch.device("cpu"), LIMIT)
    hybrid.decay = 1.0
    counts = torch.full((2, E), 2.0)
    counts[:, 9] = 6.0
    assert (6.0 - 2.0) ** 2 <= SWAP_Z ** 2 * (6.0 + 2.0)
    hybrid.counts.copy_(counts)
    assert hybrid.rebalance(max_swaps=4) == 0
    hybrid.counts.mul_(10.0)
    hybrid.counts[1, 9] = 90.0  # layer 3 gains more
    assert hybrid.rebalance(max_swaps=1) == 1
    hybrid.rebalance(max_swaps=1)  # commits layer 3's move, starts layer 0's
    assert 9 in hybrid.resident[3] and 9 not in hybrid.resident[0]


def test_swaps_off_move_nothing_and_the_counts_still_age():
    stacks = {0: layer_stacks("nvfp4", 5)}
    hybrid = HybridExperts.place(stacks, {0: [0, 1, 2]}, torch.device("cpu"), LIMIT, count_decay=0.5)
    hybrid.counts[0, 9] = 8.0
    assert hybrid.rebalance(max_swaps=0) == 0 and hybrid.resident[0] == [0, 1, 2]
    assert float(hybrid.counts[0, 9]) == 4.0


def test_from_weights_moves_stacks_out_of_the_dict():
    w = {f"layers.2.mlp.experts.{p}": s for p, s in zip(("gate_proj", "up_proj", "down_proj"), layer_stacks("fp8", 9))}
    per_expert = expert_nbytes(tuple(w.values()))
    hybrid = HybridExperts.from_weights(w, [2], LIMIT, torch.device("cpu"), budget_bytes=5 * per_expert)
    assert not w and hybrid.resident[2] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("fmt,pcie", [("nvfp4-ct", 0), ("fp8", 0), ("nvfp4-ct", 60)])
def test_tiny_model_with_experts_on_the_host_gives_the_same_tokens(tiny_dir, prompt, fmt, pcie):
    """A budget of two experts per layer puts most routed experts in the host bank; greedy tokens of
    several requests decoding together equal the all-resident engine's, and experts swap meanwhile
    (`pcie`: that share of the decode misses runs on the device after a gather from the host bank)."""
    from engine import LLM, SamplingParams

    snapshot = tiny_dir(fmt)
    resident = LLM(snapshot, dtype="float32", max_model_len=256)
    hybrid_probe = LLM(snapshot, dtype="float32", max_model_len=256, moe_vram_budget=0, pcie_expert_percent=pcie)
    per_expert = hybrid_probe.core.offload.expert_bytes
    layers = len(hybrid_probe.config.moe_layers)
    hybrid = LLM(snapshot, dtype="float32", max_model_len=256, moe_vram_budget=2 * per_expert * layers,
                 pcie_expert_percent=pcie)
    assert {len(r) for r in hybrid.core.offload.resident.values()} == {2}
    hybrid.core.offload.fetch_min_pairs = 64  # the longer prompts' prefill fetches, decode stays on the CPU
    prompts = [prompt(n, seed=n) for n in (5, 40, 17, 64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in resident.generate(prompts, params)]
    assert [o.token_ids for o in hybrid.generate(prompts, params)] == want
    assert [o.token_ids for o in hybrid_probe.generate(prompts, params)] == want  # no expert on the device
    stats = hybrid.core.stats().offload
    assert stats.host_pairs > 0 and stats.device_pairs > 0 and stats.fetched_pairs > 0 and stats.swaps > 0
    assert hybrid_probe.core.stats().offload.device_pairs == 0


def test_split_stacks_keep_the_loaders_placement():
    """Stacks the loader split (first experts on the device, the rest in the host bank) are taken as they are."""
    from engine.weights import SplitStack

    stacks = layer_stacks("nvfp4", 9)
    w = {f"layers.2.mlp.experts.{p}": SplitStack(s[torch.arange(3)], s[torch.arange(3, E)])
         for p, s in zip(("gate_proj", "up_proj", "down_proj"), stacks)}
    hybrid = HybridExperts.from_weights(w, [2], LIMIT, torch.device("cpu"), budget_bytes=0)
    assert not w and hybrid.resident[2] == [0, 1, 2] and hybrid.hosted[2] == list(range(3, E))
    x, ids, w8 = routed(7, 4, 3)
    want = TorchExperts({2: stacks}, LIMIT)(2, x, ids, w8)
    assert_expert_close(hybrid(2, x, ids, w8), want, "nvfp4")


@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
def test_large_batches_fetch_missed_experts_to_the_device(fmt):
    """Past fetch_min_pairs the misses run on the device executor from a copy of the layer's whole host bank
    (ten experts and a spare entry), whatever the staging slots of decode's PCIe share (two here)."""
    stacks = {0: layer_stacks(fmt, 11)}
    hybrid = HybridExperts.place(stacks, {0: [0, 1]}, torch.device("cpu"), LIMIT, fetch_min_pairs=8, fetch_capacity=2)
    x, ids, w = routed(16, 4, 12)
    assert_expert_close(hybrid(0, x, ids, w), TorchExperts(stacks, LIMIT)(0, x, ids, w), fmt)
    stats = hybrid.stats
    assert stats.host_pairs == 0 and stats.fetched_pairs > 8 and stats.device_pairs + stats.fetched_pairs == 64
    x, ids, w = routed(1, 4, 13)  # a decode step stays on the CPU path
    assert_expert_close(hybrid(0, x, ids, w), TorchExperts(stacks, LIMIT)(0, x, ids, w), fmt)
    assert hybrid.stats.host_pairs > 0


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_prefill_batch_copies_the_next_layers_bank_before_it_is_asked(fmt):
    """A prefill-sized batch through layer 1 queues layer 4's bank copy behind its own math: layer 4 finds it
    there; outputs equal the all-resident reference throughout. A swap committed in between makes the copy stale
    (it is taken again), and while early readiness fills the banks nothing is copied ahead."""
    stacks = {1: layer_stacks(fmt, 31), 4: layer_stacks(fmt, 34)}
    hybrid = HybridExperts.place(stacks, {1: [0, 2], 4: [3]}, torch.device("cpu"), LIMIT, fetch_min_pairs=8)
    reference = TorchExperts(stacks, LIMIT)

    def step(seed: int) -> None:
        for layer in (1, 4):
            x, ids, w = routed(16, 4, seed + layer)
            assert_expert_close(hybrid(layer, x, ids, w), reference(layer, x, ids, w), fmt)

    step(40)
    assert (hybrid.bank.loads, hybrid.bank.prefetched) == (2, 1)  # layer 1's at its call, layer 4's ahead of it
    hybrid.counts[1, 5] += 1000.0  # expert 5 of layer 1, hosted, routed far more than its residents
    x, ids, w = routed(16, 4, 41)
    hybrid(1, x, ids, w)  # layer 4's bank copied ahead again
    hybrid.rebalance(max_swaps=1)
    hybrid.rebalance(max_swaps=1)  # the move's copies are done on the CPU: committed
    assert hybrid.stats.swaps == 1 and hybrid.bank.held is None
    step(50)
    assert (hybrid.bank.loads, hybrid.bank.prefetched) == (6, 2)
    hybrid.prefetch_banks = False
    step(60)
    assert (hybrid.bank.loads, hybrid.bank.prefetched) == (8, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_host_steps_run_only_host_experts_of_live_rows(fmt, dtype):
    """The compiled host step (what a CUDA graph queues) against the reference: only pairs whose expert is
    in the host bank count, rows past the live ones (a graph's padding) stay zero, totals add up. Rows in bf16
    are staged as fp32 and the CPU's share stays fp32 (rounded once with the device's): the float32 bound
    holds against the reference on the same rounded rows."""
    from engine.kernels.experts.cpu_gemv import ExpertStacks, run_host_step  # built by `pip install -e .`
    from engine.offload.host_steps import HostSteps

    stacks = layer_stacks(fmt, 21)
    hosted = [1, 4, 5, 8, 11]
    cpu_entry = torch.full((E,), -1, dtype=torch.int64)
    cpu_entry[hosted] = torch.arange(len(hosted))
    bank = tuple(type(s)(*(getattr(s, n)[torch.tensor(hosted)] for n in tensor_fields(s))) for s in stacks)
    steps = HostSteps({3: ExpertStacks(*bank)}, {3: cpu_entry}, 4, LIMIT, 2, torch.device("cpu"), max_rows=8)
    x, ids, w = routed(6, 4, 22)
    x = x.to(dtype)
    only_hosted = w * torch.isin(ids, torch.tensor(hosted))
    want = TorchExperts({3: stacks}, LIMIT)(3, x.float(), ids, only_hosted)
    assert_expert_close(steps.run(3, x, ids, w).wait(), want, fmt)
    steps.use_rows(4)
    steps.run(3, x, ids, w)  # an eager call sets its own rows: all six
    assert_expert_close(steps.out[:6], want, fmt)
    steps.use_rows(4)
    run_host_step(steps._arguments(3, 6))  # what a replay with its last two rows padding runs
    assert_expert_close(steps.out[:4], want[:4], fmt)
    assert not steps.out[4:6].any()
    totals = steps.totals()
    hosted_pairs = int(torch.isin(ids, torch.tensor(hosted)).sum())
    assert totals.steps == 3 and totals.pairs_seen == 2 * 24 + 16
    assert totals.pairs_run == 2 * hosted_pairs + int(torch.isin(ids[:4], torch.tensor(hosted)).sum())


def doorbell_host_steps(max_rows: int = 8):
    """Host steps of MoE layers 2 and 7 (the first and the last) with every expert in the host bank, as a decode
    step's stream would ring them -> (the layers' stacks, the steps)."""
    from engine.kernels.experts.cpu_gemv import ExpertStacks
    from engine.offload.host_steps import HostSteps

    stacks = {layer: layer_stacks("nvfp4", 50 + layer) for layer in (2, 7)}
    cpu_entry = torch.arange(E, dtype=torch.int64)  # every expert in the host bank
    steps = HostSteps({layer: ExpertStacks(*s) for layer, s in stacks.items()}, {2: cpu_entry, 7: cpu_entry}, 4,
                      LIMIT, 2, torch.device("cpu"), max_rows=max_rows)
    return stacks, steps


def ring_and_wait(bell, index: int) -> None:
    """This thread plays the stream, writing the words as its memory operations would: clear the answer, ring
    host step `index`, wait for the listener's answer (which also clears the ring)."""
    from engine.offload.doorbell import DONE_WORD, RING_WORD

    bell.words[DONE_WORD] = 0
    bell.words[RING_WORD] = index + 1
    deadline = time.monotonic() + 10
    while int(bell.words[DONE_WORD]) != index + 1:
        assert time.monotonic() < deadline, "the doorbell was not answered"
    assert int(bell.words[RING_WORD]) == 0


@pytest.mark.parametrize("nap", [False, True])
def test_a_rung_doorbell_runs_that_host_step_once_and_answers(nap):
    """The listener a decode step's stream rings: each ring runs the named layer's host step once and answers
    with the ring's value, also when the same step rings twice in a row (the answer word is cleared before each
    ring) and when the listener was napping and nobody armed it."""
    from engine.offload.doorbell import Doorbell

    stacks, steps = doorbell_host_steps()
    bell = Doorbell(2 * 8, spin_ns=200_000, device=torch.device("cpu"))
    for layer in (2, 7):
        bell.name(steps._bell_index(layer, 3), ctypes.addressof(steps._arguments(layer, 3)))

    def ring(layer: int) -> torch.Tensor:
        if nap:
            time.sleep(0.01)  # past the listener's spin: it naps
        ring_and_wait(bell, steps._bell_index(layer, 3))
        return steps.out[:3].clone()

    try:
        for layer, seed in [(2, 60), (2, 61), (7, 62)]:
            x, ids, w = routed(3, 4, seed)
            steps.x[:3], steps.ids[:3], steps.weights[:3] = x, ids, w
            steps.live_rows.value = 3
            assert_expert_close(ring(layer), TorchExperts(stacks, LIMIT)(layer, x, ids, w), "nvfp4")
        assert steps.totals().steps == 3
    finally:
        bell.close()


@pytest.mark.parametrize("layer,rows", [(7, 8), (2, 1), (2, 8), (7, 1)])
def test_every_doorbell_index_runs_its_own_host_step(layer, rows):
    """Each (layer, rows) host step has an index of its own inside the doorbell's table: with every one named (as
    once decode graphs of every batch size are captured), a ring at the table's two ends (the last layer at
    max_rows, the first at one row) and at the seam between the layers runs that step once, on its rows, with
    the reference's output, and no other step."""
    from engine.offload.doorbell import Doorbell

    stacks, steps = doorbell_host_steps(max_rows=8)
    bell = Doorbell(2 * 8, spin_ns=200_000, device=torch.device("cpu"))
    try:
        for each in (2, 7):
            for n in range(1, 9):
                bell.name(steps._bell_index(each, n), ctypes.addressof(steps._arguments(each, n)))
        named = len(set(bell.table.tolist()) - {0})
        assert named == 2 * 8, "two host steps share a doorbell index"
        x, ids, w = routed(rows, 4, 70 + rows)
        steps.x[:rows], steps.ids[:rows], steps.weights[:rows] = x, ids, w
        steps.live_rows.value = rows
        ring_and_wait(bell, steps._bell_index(layer, rows))
        assert_expert_close(steps.out[:rows], TorchExperts(stacks, LIMIT)(layer, x, ids, w), "nvfp4")
        ran = {key: (args.steps, args.pairs_seen) for key, args in steps._args.items() if args.steps}
        assert ran == {(layer, rows): (1, rows * 4)}
    finally:
        bell.close()


@pytest.mark.parametrize("percent", [0, 1, 10, 33, 41, 44, 50, 67, 99, 100])
def test_the_pcie_share_of_a_layers_misses_lets_the_later_side_finish_soonest(percent):
    """N parts (n misses of 16 parts each at the release's width) send the count k that minimises the later
    finish, max(k / percent, (N - k) / (100 - percent)), ties to the CPU (brute force): whole experts at one to
    three misses a layer (batch 1) left one side idle: two misses at 33% sent none (the CPU ran both), now 10
    of their 32 parts."""
    from engine.kernels.experts.pcie_pick import pcie_share, split_units

    def best(n: int) -> int:  # cross-multiplied by percent * (100 - percent): no division by zero
        return min(range(n + 1), key=lambda k: (max(k * (100 - percent), (n - k) * percent), k))

    for parts in range(0, 60):
        assert int(pcie_share(torch.tensor(parts), percent)) == best(parts), parts
    assert split_units(2048) == 16 and split_units(64) == 1 and split_units(200) == 1
    assert int(pcie_share(torch.tensor(2 * 16), 33)) == 10 and int(pcie_share(torch.tensor(2), 33)) == 0


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("percent,dtype", [
    pytest.param(41, torch.float32, id="41-fp32"), pytest.param(50, torch.float32, id="50-fp32"),
    pytest.param(100, torch.float32, id="100-fp32"), pytest.param(50, torch.bfloat16, id="50-bf16")])
def test_misses_split_between_pcie_and_cpu_equal_the_reference(fmt, percent, dtype):
    """A share of each step's misses runs on the device after a gather from the host bank, the rest on the
    CPU; each missed pair runs exactly once (equality), and the staging slots bound the device's share."""
    stacks = {1: layer_stacks(fmt, 31), 4: layer_stacks(fmt, 37)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = HybridExperts.place(stacks, {1: [0, 2], 4: [3]}, torch.device("cpu"), LIMIT, fetch_capacity=4,
                                 pcie_percent=percent)
    for layer in (1, 4):
        for t, seed in [(1, 40), (6, 41), (3, 42)]:
            x, ids, w = routed(t, 4, seed)
            x = x.to(dtype)
            assert_routed_close(hybrid(layer, x, ids, w), reference(layer, x.float(), ids, w), fmt, dtype)
    stats = hybrid.stats
    assert stats.device_pairs + stats.host_pairs + stats.fetched_pairs == 2 * 4 * (1 + 6 + 3)
    assert stats.fetched_pairs > 0 and stats.host_pairs > 0  # 100%: past the 4 staging slots, the CPU
    assert stats.fetched_pairs <= 2 * 3 * 4


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])  # the formats with a compiled CPU pass
@pytest.mark.parametrize("percent", [20, 41, 50])
def test_experts_split_between_pcie_and_cpu_add_up_to_the_reference(fmt, percent):
    """At a width of two 128-row parts an expert splits between the link and the CPU: the device stages its
    first part (gate and up rows, down columns) and the CPU runs the rest; together every missed pair once
    (equality), with some pairs split and the bytes counted on each side by its parts."""
    stacks = {1: layer_stacks(fmt, 71, inter=256), 4: layer_stacks(fmt, 73, inter=256)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = HybridExperts.place(stacks, {1: [0, 2], 4: [3]}, torch.device("cpu"), LIMIT, fetch_capacity=4,
                                 pcie_percent=percent)
    assert hybrid.split_units == 2
    for layer in (1, 4):
        for t, seed in [(1, 80), (1, 81), (6, 82), (3, 83)]:
            x, ids, w = routed(t, 4, seed)
            assert_expert_close(hybrid(layer, x, ids, w), reference(layer, x, ids, w), fmt)
    split = sum(steps.totals().units_left for steps in hybrid.host_steps.values())
    assert split > 0  # some experts ran in two parts
    stats = hybrid.stats
    assert stats.device_pairs + stats.host_pairs + stats.fetched_pairs == 2 * 4 * (1 + 1 + 6 + 3)
    totals = next(iter(hybrid.host_steps.values())).totals()
    assert stats.host_bytes == totals.experts_run * hybrid.expert_bytes - split * hybrid.expert_bytes // 2


@pytest.mark.parametrize("fmt,programs", [("dense", 4), ("fp8", 4), ("nvfp4", 4), ("nvfp4", 7)])
def test_the_gather_kernel_equals_the_reference_and_stages_an_experts_first_parts(fmt, programs, monkeypatch):
    """One launch for every tensor of the three stacks (Triton in the interpreter here) equals the torch
    reference; a slot of all the parts holds the host expert, a slot of some holds its first intermediate rows
    (gate and up rows, down columns), the gate and up scales past them zero (their outputs then are) and the
    rest of the down columns as they were; a slot without an entry is untouched. The programs (one an SM) each
    loop over blocks of several slots; 7 leave the last step short."""
    from engine.kernels.experts import gather
    from engine.kernels.experts.gather import gather_experts_torch, gather_experts_triton, gather_plan
    from engine.weights import map_tensors

    monkeypatch.setattr(gather, "sm_count", lambda device: programs)
    host = layer_stacks(fmt, 61, inter=256)
    staged = [tuple(map_tensors(s, lambda t: torch.ones((3, *t.shape[1:]), dtype=t.dtype)) for s in host)
              for _ in range(2)]
    entries, parts = torch.tensor([4, -1, 9]), torch.tensor([2, 0, 1])
    for staging, run in zip(staged, (gather_experts_torch, gather_experts_triton)):
        plan = gather_plan(staging, host, 2)
        run(plan, entries, parts)
    assert 3 * plan.blocks > 2 * programs and (programs == 4 or 3 * plan.blocks % programs)
    for want, got in zip(staged[0], staged[1]):
        for name in tensor_fields(want):
            assert torch.equal(getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    gate, up, down = staged[0]
    for name in tensor_fields(gate):
        assert torch.equal(getattr(gate, name)[0], getattr(host[0], name)[4])  # whole
        assert torch.equal(getattr(down, name)[0], getattr(host[2], name)[4])
        assert (getattr(gate, name)[1].float() == 1).all()  # no entry
    scale = {"dense": "data", "fp8": "scale_inv", "nvfp4": "scale"}[fmt]
    rows = getattr(gate, scale).shape[1] // 2  # the first of two parts of slot 2
    assert torch.equal(getattr(up, scale)[2, :rows], getattr(host[1], scale)[9, :rows])
    assert not getattr(up, scale)[2, rows:].float().any()
    codes = {"dense": "data", "fp8": "data", "nvfp4": "packed"}[fmt]
    cols = getattr(down, codes).shape[-1] // 2
    assert torch.equal(getattr(down, codes)[2, :, :cols].view(torch.uint8),
                       getattr(host[2], codes)[9, :, :cols].view(torch.uint8))
    assert (getattr(down, codes)[2, :, cols:].float() == 1).all()
    with pytest.raises(ValueError, match="does not split"):
        gather_plan(staged[0], host, 3)


def test_the_split_follows_the_cpus_rate_inside_the_steps():
    """From measured rates, every FOLLOW_STEPS decode steps the share becomes what the CPU's passes reached in
    them against the link's rate: the host steps and the device's pick read it from the next step on, the
    outputs still equal the reference; a requested share stays."""
    from engine.offload.miss_split import pcie_percent
    from engine.offload.split_follower import FOLLOW_STEPS

    stacks = {1: layer_stacks("nvfp4", 91, inter=256), 4: layer_stacks("nvfp4", 93, inter=256)}
    reference = TorchExperts(stacks, LIMIT)
    hybrid = HybridExperts.place(stacks, {1: [0, 2], 4: [3]}, torch.device("cpu"), LIMIT, fetch_capacity=4)
    hybrid.split_misses(50, (1e6, 1e9))  # a CPU far slower than this machine's: half the misses to start
    hybrid(1, *routed(1, 4, 99))  # a start's warm-up: not followed
    assert hybrid.follow_cpu_rate() is None
    start = hybrid._host_totals()
    for step in range(FOLLOW_STEPS):
        for layer in (1, 4):
            x, ids, w = routed(1, 4, 100 + step)
            assert_expert_close(hybrid(layer, x, ids, w), reference(layer, x, ids, w), "nvfp4")
        assert step == FOLLOW_STEPS - 1 or hybrid.follow_cpu_rate() is None  # not yet
    steps, seconds, nbytes = (now - then for now, then in zip(hybrid._host_totals(), start))
    assert steps == FOLLOW_STEPS and seconds > 0 and nbytes > 0
    want = max(1, round((50 + pcie_percent(nbytes / seconds, 1e9)) / 2))  # halfway
    assert hybrid.follow_cpu_rate() == want == hybrid.pcie_percent == int(hybrid._percent_on_device)
    assert all(args.pcie_percent == want for steps in hybrid.host_steps.values() for args in steps._args.values())
    x, ids, w = routed(3, 4, 120)
    assert_expert_close(hybrid(1, x, ids, w), reference(1, x, ids, w), "nvfp4")
    fixed = HybridExperts.place(stacks, {1: [0, 2], 4: [3]}, torch.device("cpu"), LIMIT, pcie_percent=30)
    for step in range(FOLLOW_STEPS + 1):
        fixed(1, *routed(1, 4, step)), fixed(4, *routed(1, 4, step))
    assert fixed.follow_cpu_rate() is None and fixed.pcie_percent == 30
    with pytest.raises(RuntimeError, match="on or off"):
        fixed.split_misses(0)


def test_the_split_follows_the_highest_recent_window(monkeypatch):
    """A window whose steps were not back to back reads a rate far below the pass's own: the split follows the
    highest of the last FOLLOW_WINDOWS windows' rates, the load's measurement first, so one slow window moves
    nothing and a lasting change still comes through once the faster windows have aged out."""
    from engine.offload.miss_split import pcie_percent
    from engine.offload.split_follower import FOLLOW_STEPS, FOLLOW_WINDOWS

    stacks = {1: layer_stacks("nvfp4", 91, inter=256)}
    hybrid = HybridExperts.place(stacks, {1: [0, 2]}, torch.device("cpu"), LIMIT)
    hybrid.split_misses(58, (32e9, 46e9))
    hybrid(1, *routed(1, 4, 1))  # the host steps exist
    totals = [(0, 0.0, 0)]  # (steps, seconds, bytes) since start, one entry a window
    monkeypatch.setattr(hybrid, "_host_totals", lambda: totals[-1])

    def window(rate: float) -> int | None:
        steps, seconds, nbytes = totals[-1]
        totals.append((steps + FOLLOW_STEPS, seconds + 1.0, nbytes + int(rate)))
        for _ in range(FOLLOW_STEPS - 1):
            assert hybrid.follow_cpu_rate() is None
        return hybrid.follow_cpu_rate()

    assert hybrid.follow_cpu_rate() is None  # the first look: the warm-up, not followed
    shares, used = [58], [32e9]
    for rate in [6e9, 48e9, 60e9, 70e9, 20e9, 20e9, 20e9, 20e9]:
        used = (used + [rate])[-FOLLOW_WINDOWS:]
        shares.append(max(1, round((shares[-1] + pcie_percent(max(used), 46e9)) / 2)))
        assert window(rate) == shares[-1] == hybrid.pcie_percent
    assert shares[1] == 58  # the slow window moved nothing (the load's 32 GB/s still counts)
    assert shares[4] < shares[3] < shares[2] < 58  # faster windows: more to the CPU
    assert max(shares[5:8]) <= shares[4] < shares[8]  # a lasting slowdown comes through once 70 GB/s ages out


def test_the_gather_kernel_compiles_for_sm90(tmp_path):
    """Both element widths (words at the release's shapes, bytes elsewhere) compile for sm_90 (the interpreter
    the test above runs in takes code the compiler rejects)."""
    from tests.engine.kernels.sm90 import assert_compiles_for_sm90

    assert_compiles_for_sm90("""
import triton.language as tl
from engine.kernels.experts.gather import _gather_kernel
pointers = dict(table_ptr="*i64", entries_ptr="*i64", units_ptr="*i64")
for element in (tl.int32, tl.uint8):
    compile_for_sm90(_gather_kernel, pointers, dict(PARTS=9, PARTS_BLOCK=16, UNITS=16, ELEMENT=element, BLOCK=4096,
                                                    BLOCKS=3459, SLOTS=8, SLOTS_BLOCK=8, PROGRAMS=132,
                                                    RUNTIME_BOUND=True), 4)
print("compiled")
""", tmp_path)


def test_miss_split_follows_the_measured_rates():
    from engine.offload.miss_split import miss_rates, pcie_percent

    assert pcie_percent(30e9, 50e9) == 62 and pcie_percent(1.0, 0.0) == 0 and pcie_percent(0.0, 0.0) == 0
    hybrid = HybridExperts.place({0: layer_stacks("nvfp4", 3)}, {0: [0]}, torch.device("cpu"), LIMIT)
    cpu, pcie = miss_rates(hybrid, experts=4)
    assert cpu > 0 and pcie > 0
    with pytest.raises(ValueError, match="pcie_percent"):
        hybrid.split_misses(101)


class SteppingClock:
    """A perf_counter that moves `step` seconds at each read: every timed call takes exactly `step`."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("experts,capacity,n", [(4, 8, 4), (8, 3, 3), (20, 16, 11)])
def test_miss_rates_are_the_bytes_of_every_expert_timed_over_the_time(monkeypatch, experts, capacity, n):
    """Each rate is the bytes of the n experts its pass ran (`experts`, at most the host bank's 11 and the staging
    slots) over the pass's time: with a clock where every pass takes 0.125 s, n experts' bytes (counted here from
    the stacks' tensors) / 0.125 s, and the CPU pass and the PCIe gather each ran those n experts whole."""
    from engine.offload import miss_split

    stacks = layer_stacks("nvfp4", 3)
    one_expert = sum(getattr(s, name).nbytes for s in stacks for name in tensor_fields(s)) // E
    hybrid = HybridExperts.place({0: stacks}, {0: [0]}, torch.device("cpu"), LIMIT, fetch_capacity=capacity)
    ran = {}
    compiled = hybrid.host_run.compiled[0]
    forward, gather = compiled.forward, hybrid.fetch.gather

    def cpu_pass(x, ids, starts, weights, *rest):
        ran["cpu"] = (len(x), ids.tolist(), starts.tolist())
        return forward(x, ids, starts, weights, *rest)

    def pcie_gather(bank, entries, parts, units):
        ran["pcie"] = (entries[entries >= 0].tolist(), parts[entries >= 0].tolist(), units)
        return gather(bank, entries, parts, units)

    monkeypatch.setattr(compiled, "forward", cpu_pass)
    monkeypatch.setattr(hybrid.fetch, "gather", pcie_gather)
    monkeypatch.setattr(miss_split, "time", SteppingClock(0.125))
    cpu, pcie = miss_split.miss_rates(hybrid, experts=experts)
    assert ran["cpu"] == (n, list(range(n)), list(range(n + 1)))  # one row each of n distinct host experts
    assert ran["pcie"] == (list(range(n)), [hybrid.split_units] * n, hybrid.split_units)  # n whole experts
    assert cpu == pytest.approx(n * one_expert / 0.125, rel=1e-12)
    assert pcie == pytest.approx(n * one_expert / 0.125, rel=1e-12)


def test_measured_rates_are_kept_under_their_key(tmp_path):
    """Kept whole under what they depend on; another key, a torn or foreign file reads as nothing kept."""
    from engine.offload.miss_split import cached_rates, keep_rates, rates_key

    hybrid = HybridExperts.place({0: layer_stacks("nvfp4", 3)}, {0: [0]}, torch.device("cpu"), LIMIT)
    key = rates_key(hybrid)
    assert key["threads"] == hybrid.host_run.threads and key["format"] == "Nvfp4Weight"
    assert key["expert_bytes"] == hybrid.expert_bytes and key["cpus"] >= 1
    path = tmp_path / "not-yet" / "miss_split.json"  # a local source's cache folder before its first write
    assert cached_rates(path, key) is None
    keep_rates(path, key, (12e9, 40e9))
    assert cached_rates(path, key) == (12e9, 40e9)
    assert not path.with_name(path.name + ".partial").exists()
    assert cached_rates(path, {**key, "threads": key["threads"] + 1}) is None  # another machine or setting
    assert cached_rates(path, {**key, "format": "Fp8BlockWeight"}) is None
    path.write_text('{"key": ')
    assert cached_rates(path, key) is None
    path.write_text('[1, 2]')
    assert cached_rates(path, key) is None


def test_the_boot_log_gives_the_expected_decode_rate(tiny_dir, caplog):
    """Timed batch-1 steps on the scratch slot: a positive rate in the log, and requests after it decode as
    an engine without experts on the host does."""
    from engine import LLM, SamplingParams

    snapshot = tiny_dir("nvfp4-ct")
    resident = LLM(snapshot, "cpu", "float32", max_model_len=256)
    with caplog.at_level("INFO", logger="glmflash.engine"):
        hybrid = LLM(snapshot, "cpu", "float32", max_model_len=256, moe_vram_budget=0)
    probe = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=decode_probe")]
    assert len(probe) == 1 and "batch=1" in probe[0], probe
    assert float(probe[0].split("expected_tok_s=")[1].split()[0]) > 0
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7], [3] * 30]
    assert ([o.token_ids for o in hybrid.generate(prompts, params)]
            == [o.token_ids for o in resident.generate(prompts, params)])
