"""The swap policy on plain count tensors: which moves the margin and the z-score let through, in which order."""

from __future__ import annotations

import torch

from engine.offload.swap_policy import SWAP_MARGIN, SWAP_Z, SwapPolicy, pick_moves

E = 6


def layout(layers: int, resident: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hosted, busy, open_layers) for `layers` layers with the same resident experts, nothing moving, every
    layer with a spare host entry."""
    hosted = torch.ones(layers, E, dtype=torch.bool)
    hosted[:, resident] = False
    return hosted, torch.zeros_like(hosted), torch.ones(layers, dtype=torch.bool)


def policy_moves(counts: torch.Tensor, hosted, busy, open_layers, limit: int = 10) -> list[tuple[int, int, int]]:
    return SwapPolicy(counts.shape[0], E, torch.device("cpu")).moves(counts, hosted, busy, open_layers, limit)


def test_the_hottest_outside_expert_takes_the_coldest_residents_slot():
    counts = torch.tensor([[500.0, 100.0, 300.0, 20.0, 900.0, 700.0]])
    assert policy_moves(counts, *layout(1, [0, 1, 2])) == [(0, 4, 1)]


def test_a_gain_within_the_margin_moves_nothing():
    """Well past the z-score, but routed only SWAP_MARGIN times as often as the resident: no move; above it: a
    move."""
    counts = torch.zeros(1, E)
    counts[0, :3] = torch.tensor([4000.0, 1000.0, 3000.0])
    counts[0, 4] = 1000.0 * SWAP_MARGIN
    assert (counts[0, 4] - 1000.0) ** 2 > SWAP_Z ** 2 * (counts[0, 4] + 1000.0)  # the z-score alone would pass
    assert policy_moves(counts, *layout(1, [0, 1, 2])) == []
    counts[0, 4] += 1.0
    assert policy_moves(counts, *layout(1, [0, 1, 2])) == [(0, 4, 1)]


def test_a_gain_within_the_noise_moves_nothing():
    """6 routings against 2 are three times as many (past the margin) but within SWAP_Z standard deviations of
    equal routing; ten times those counts are not."""
    counts = torch.full((1, E), 2.0)
    counts[0, 4] = 6.0
    assert 6.0 > 2.0 * SWAP_MARGIN
    assert policy_moves(counts, *layout(1, [0, 1, 2])) == []
    assert policy_moves(counts * 10, *layout(1, [0, 1, 2])) == [(0, 4, 0)]  # ties: the lowest id


def test_experts_in_a_move_and_layers_without_a_spare_entry_are_left_out():
    counts = torch.tensor([[10.0, 50.0, 900.0, 800.0, 60.0, 40.0]] * 2)
    hosted, busy, open_layers = layout(2, [0, 1, 4])
    busy[0, [2, 0]] = True  # layer 0's hottest outside and coldest resident are moving already
    open_layers[1] = False
    assert policy_moves(counts, hosted, busy, open_layers) == [(0, 3, 1)]


def test_the_largest_gain_goes_first_and_the_limit_keeps_it():
    counts = torch.zeros(3, E)
    counts[:, :3] = 100.0
    counts[0, 4], counts[1, 4], counts[2, 5] = 400.0, 900.0, 600.0
    every = policy_moves(counts, *layout(3, [0, 1, 2]))
    assert every == [(1, 4, 0), (2, 5, 0), (0, 4, 0)]
    assert policy_moves(counts, *layout(3, [0, 1, 2]), limit=2) == every[:2]


def test_every_move_takes_any_gain_but_not_a_tie():
    """A calibration's placement settles exactly: an outside expert routed once more than a resident moves in,
    one routed as often does not."""
    counts = torch.tensor([[5.0, 5.0, 5.0, 5.0, 6.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0, 0.0]])
    hosted, busy, open_layers = layout(2, [0, 1, 2])
    assert SwapPolicy.every_move(counts, hosted, busy, open_layers) == [(0, 4, 0)]
    assert pick_moves(counts, hosted, busy, open_layers, SWAP_MARGIN, SWAP_Z) == []


def test_the_counts_age_by_the_decay_once_a_read():
    policy = SwapPolicy(2, E, torch.device("cpu"), decay=0.5)
    policy.counts[1, 3] = 8.0
    policy.age()
    assert float(policy.counts[1, 3]) == 4.0
    counts = policy.read()
    assert counts.device.type == "cpu" and float(policy.counts[1, 3]) == 2.0
