"""The prepared snapshot's background write paced behind serving (worker/prepare_pace.py), on a fake clock."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from worker.prepare_pace import ServingFirst


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += seconds
        return False


def on_a_writer_thread(write) -> None:
    """`write()` on a thread of its own, as the snapshot's writers run (pacing lowers the calling thread's
    scheduling class for good: not the test runner's)."""
    errors = []

    def run() -> None:
        try:
            write()
        except BaseException as error:  # re-raised on the test's thread
            errors.append(error)

    writer = threading.Thread(target=run)
    writer.start()
    writer.join()
    if errors:
        raise errors[0]


def test_idle_it_writes_unpaced_and_busy_at_the_busy_rate():
    t, busy = FakeTime(), [False]
    pace = ServingFirst(lambda: busy[0], busy_bytes_per_s=100e6, wait=t.wait, clock=t.clock)
    on_a_writer_thread(lambda: [pace(64 << 20) for _ in range(5)])
    assert t.now == 0 and pace.paced_s == 0
    busy[0] = True
    on_a_writer_thread(lambda: [pace(50_000_000) for _ in range(10)])
    assert abs(t.now - 4.5) < 1e-9  # 10 pieces of 50 MB at 100 MB/s: the first at once, each next 0.5 s on
    assert abs(pace.paced_s - 4.5) < 1e-9


def test_at_rate_zero_it_waits_until_no_request_runs_or_the_write_stops():
    t, polls = FakeTime(), []

    def busy() -> bool:
        polls.append(t.now)
        return len(polls) < 20

    pace = ServingFirst(busy, busy_bytes_per_s=0, wait=t.wait, clock=t.clock)
    on_a_writer_thread(lambda: pace(1 << 20))
    assert len(polls) == 20 and t.now > 0.5
    stop = threading.Event()
    stop.set()
    stopped = ServingFirst(lambda: True, busy_bytes_per_s=0, wait=stop.wait)
    on_a_writer_thread(lambda: stopped(1 << 20))  # returns at once: the write is being stopped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity as Linux has it")
def test_the_writing_threads_run_beside_the_expert_cores_at_the_normal_priority():
    """A thread that paces a piece runs on the CPUs `cpus()` names from then on, under the normal policy; the
    caller's other threads keep their CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    pace = ServingFirst(lambda: False, busy_bytes_per_s=0, wait=lambda seconds: False, cpus=lambda: allowed[-1:])
    seen = {}

    def write() -> None:
        pace(1 << 20)
        seen["cpus"] = os.sched_getaffinity(threading.get_native_id())
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    on_a_writer_thread(write)
    assert seen == {"cpus": {allowed[-1]}, "policy": os.SCHED_OTHER, "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    assert sorted(os.sched_getaffinity(threading.get_native_id())) == allowed
