"""The prepared snapshot's background write paced behind serving.

A cold start writes its prepared snapshot after ready, while requests run. Unpaced, its threads (hashing, staging
copies, the writes' page-cache churn) took the cores and the memory bandwidth that hybrid offload's CPU expert
pass lives on, and decode fell to a fraction of its rate for as long as the write lasted. So the writing threads
run on the CPUs no expert worker is pinned to (`engine.cpu_cores.background_cpus`), at the normal priority: below
it (nice 19, then SCHED_IDLE) a writer that took the GIL waited for a core the spinning expert threads held, and
the serving thread waited on it (decode at 0.53, then 0.47 of its rate during a write on an H100; stalls of
0.3-0.6 s between steps). While requests run the write goes one piece at a time at `busy_bytes_per_s` (0: it
waits until no request runs); idle, it runs at the disk's rate.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from engine.cpu_cores import background_cpus


class ServingFirst:
    def __init__(self, busy: Callable[[], bool], busy_bytes_per_s: float, wait: Callable[[float], object],
                 clock: Callable[[], float] = time.monotonic, cpus: Callable[[], list[int]] = background_cpus) -> None:
        """`busy()`: whether requests run now; `wait(seconds)`: sleeps, and returns early when the write is
        stopped (a threading.Event's wait); `cpus()`: where the writing threads may run."""
        self.busy, self.rate, self.wait, self.clock, self.cpus = busy, busy_bytes_per_s, wait, clock, cpus
        self.paced_s = 0.0  # time the write spent yielding
        self._lock = threading.Lock()  # while busy, one piece at a time
        self._next = 0.0  # when the next piece may start, at the busy rate
        self._placed: set[int] = set()

    def __call__(self, size: int) -> None:
        """Before a piece of `size` bytes, on the writing thread."""
        self._keep_off_expert_cores()
        if not self.busy():
            return
        with self._lock:
            start = self.clock()
            while self.rate <= 0 and self.busy():
                if self.wait(0.05):
                    break
            if self.rate > 0:
                delay = self._next - self.clock()
                if delay > 0:
                    self.wait(delay)
                self._next = max(self.clock(), self._next) + size / self.rate
            self.paced_s += self.clock() - start

    def _keep_off_expert_cores(self) -> None:
        thread = threading.get_native_id()
        if thread in self._placed:
            return
        self._placed.add(thread)
        try:  # Linux: a thread id names the thread alone
            os.sched_setaffinity(thread, self.cpus())
        except (OSError, AttributeError):
            pass  # elsewhere, or not permitted: the pace alone
