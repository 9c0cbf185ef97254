"""The split follower on plain host-step totals: when it looks, which windows move the PCIe share, and where."""

from __future__ import annotations

from engine.offload.split_follower import FOLLOW_STEPS, FOLLOW_WINDOWS, SplitFollower

GB = 1e9


def started(percent: int = 50, load: tuple[float, float] = (10 * GB, 10 * GB)) -> SplitFollower:
    """A follower past its first look (the start's warm-up) at totals of zero."""
    follower = SplitFollower()
    assert follower.due()
    assert follower.follow(percent, (0, 0.0, 0), load) is None  # the warm-up is not followed
    return follower


def test_it_looks_at_the_first_call_then_every_follow_steps():
    follower = started()
    for _ in range(3):
        assert [follower.due() for _ in range(FOLLOW_STEPS)] == [False] * (FOLLOW_STEPS - 1) + [True]


def test_a_faster_cpu_lowers_the_share_and_a_slower_start_raises_it():
    """Halfway to where both sides take as long: a CPU window at 30 GB/s against a 10 GB/s link asks for 25%;
    from 50% the share goes to 38 (37.5 rounded to even). From a share of 20 at a 10 GB/s CPU (50% asked) it
    goes to 35."""
    follower = started(50)
    assert follower.follow(50, (FOLLOW_STEPS, 1.0, int(30 * GB)), (10 * GB, 10 * GB)) == 38
    follower = started(20)
    assert follower.follow(20, (FOLLOW_STEPS, 1.0, int(10 * GB)), (10 * GB, 10 * GB)) == 35


def test_a_short_window_waits_for_more_steps_from_the_same_start():
    follower = started(50)
    assert follower.follow(50, (FOLLOW_STEPS - 1, 1.0, int(30 * GB)), (10 * GB, 10 * GB)) is None
    # the window still starts at zero: 60 GB over 2 s is 30 GB/s, not the 30 GB over 1 s since the short look
    assert follower.follow(50, (FOLLOW_STEPS + 1, 2.0, int(60 * GB)), (10 * GB, 10 * GB)) == 38


def test_a_window_without_cpu_time_moves_nothing_and_is_passed():
    follower = started(50)
    assert follower.follow(50, (FOLLOW_STEPS, 0.0, int(10 * GB)), (10 * GB, 10 * GB)) is None
    # the next window starts where that one ended: 30 GB in 1 s (40 GB/s from the start would give 35)
    assert follower.follow(50, (2 * FOLLOW_STEPS, 1.0, int(40 * GB)), (10 * GB, 10 * GB)) == 38


def test_the_highest_recent_window_counts_the_loads_rate_first():
    """A slow window moves nothing while the load's rate is among the last FOLLOW_WINDOWS; once it has aged out,
    the slow windows pull the share up."""
    follower, percent, totals = started(50), 50, (0, 0.0, 0)
    shares = []
    for _ in range(FOLLOW_WINDOWS):
        totals = (totals[0] + FOLLOW_STEPS, totals[1] + 1.0, totals[2] + int(5 * GB))
        percent = follower.follow(percent, totals, (10 * GB, 10 * GB))
        shares.append(percent)
    assert shares[:-1] == [50] * (FOLLOW_WINDOWS - 1)  # the load's 10 GB/s still the highest
    assert shares[-1] == 58  # 5 GB/s against 10: 67% asked, halfway from 50 (58.5 rounded to even)


def test_the_share_never_falls_to_0():
    """0 would turn the PCIe path off, which only happens before the first decode step: a CPU far faster than
    the link asks for 0%, and from 1% the share stays at 1."""
    follower = started(1)
    assert follower.follow(1, (FOLLOW_STEPS, 1.0, int(1e6 * GB)), (10 * GB, 10 * GB)) == 1
