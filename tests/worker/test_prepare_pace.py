"""The prepared snapshot's background write paced behind serving (worker/prepare_pace.py), on a fake clock."""

from __future__ import annotations

import threading

from worker.prepare_pace import ServingFirst


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        return False


def test_idle_it_writes_unpaced_and_busy_at_the_busy_rate():
    t, busy = FakeTime(), [False]
    pace = ServingFirst(lambda: busy[0], busy_bytes_per_s=100e6, wait=t.wait, clock=t.clock)
    for _ in range(5):
        pace(64 << 20)
    assert t.now == 0 and pace.paced_s == 0
    busy[0] = True
    for _ in range(10):
        pace(50_000_000)
    assert abs(t.now - 4.5) < 1e-9  # 10 pieces of 50 MB at 100 MB/s: the first at once, each next 0.5 s on
    assert abs(pace.paced_s - 4.5) < 1e-9


def test_at_rate_zero_it_waits_until_no_request_runs_or_the_write_stops():
    t, polls = FakeTime(), []

    def busy() -> bool:
        polls.append(t.now)
        return len(polls) < 20

    pace = ServingFirst(busy, busy_bytes_per_s=0, wait=t.wait, clock=t.clock)
    pace(1 << 20)
    assert len(polls) == 20 and t.now > 0.5
    stop = threading.Event()
    stop.set()
    stopped = ServingFirst(lambda: True, busy_bytes_per_s=0, wait=stop.wait)
    stopped(1 << 20)  # returns at once: the write is being stopped
