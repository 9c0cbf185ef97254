"""The draft length a step gets: every k timed first (largest first), then the one with the most expected tokens a
second from the measured acceptance and step times, per batch-size bucket, with a step for another k now and then."""

from __future__ import annotations

import pytest

from engine.draft_length import DraftLength


def timed_all(length: DraftLength, batch: int, seconds: dict[int, float]) -> None:
    for k, s in seconds.items():
        length.timed(batch, k, s)


def test_each_k_is_timed_first_largest_first():
    length = DraftLength(3)
    assert [length.choose(1) for _ in range(1)] == [3]
    length.timed(1, 3, 1.0)
    assert length.choose(1) == 2
    timed_all(length, 1, {2: 1.0, 1: 1.0, 0: 1.0})
    assert length.choose(4) == 3  # another bucket: timed anew


def test_accepted_drafts_and_a_cheap_verify_choose_the_most():
    length = DraftLength(3)
    timed_all(length, 1, {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15})
    for _ in range(50):
        length.verdict(3, 3)  # every draft accepted
    assert length.expected_tokens(3) == pytest.approx(1 + sum((51 / 52) ** j for j in (1, 2, 3)))
    assert length.choose(1) == 3


def test_rejected_drafts_or_a_costly_verify_choose_none():
    rejected = DraftLength(2)
    timed_all(rejected, 1, {0: 1.0, 1: 1.1, 2: 1.2})
    for _ in range(50):
        rejected.verdict(2, 0)
    assert rejected.tried == [50, 0] and rejected.accepted == [0, 0]  # the second was never reached
    assert rejected.choose(1) == 0
    costly = DraftLength(2)
    timed_all(costly, 4, {0: 1.0, 1: 2.5, 2: 4.0})  # the union of experts over k + 1 positions, say
    for _ in range(50):
        costly.verdict(2, 2)
    assert costly.choose(4) == 0 and costly.choose(1) == 2  # batch 1 untimed: tried first


def test_acceptance_falling_with_position_stops_where_the_next_draft_no_longer_pays():
    length = DraftLength(3)
    timed_all(length, 1, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3})
    for _ in range(100):
        length.verdict(3, 1)  # the first always accepted, the second never
    assert length.acceptance(1) > 0.95 and length.acceptance(2) < 0.05
    assert length.choose(1) == 1


def test_another_k_runs_every_explore_every_steps_and_times_average():
    length = DraftLength(2, explore_every=4)
    timed_all(length, 1, {0: 1.0, 1: 1.0, 2: 1.0})
    picks = [length.choose(1) for _ in range(8)]
    assert picks.count(2) == 6 and sorted(p for p in picks if p != 2) == [0, 1]  # priors favour drafting
    length.timed(1, 2, 2.0)
    assert length.times[1, 2] == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)
