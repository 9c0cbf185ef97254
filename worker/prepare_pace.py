"""The prepared snapshot's background write paced behind serving.

A cold start writes its prepared snapshot after ready, while requests run. Unpaced, its threads (hashing, staging
copies, the writes' page-cache churn) took the cores and the memory bandwidth that hybrid offload's CPU expert
pass lives on, and decode fell to a fraction of its rate for as long as the write lasted. So the writing threads
run under Linux's SCHED_IDLE policy (a core runs them only when nothing else wants it, and a waking expert thread
takes the core back at once; at nice 19 they still took time slices from the pinned expert threads, and one
delayed thread holds up the whole fork-join pass: decode ran at 0.53 of its rate during a write on an H100), and
while requests run the write goes one piece at a time at `busy_bytes_per_s` (0: it waits until no request runs);
idle, it runs at the disk's rate.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

LOWEST_PRIORITY = 19  # the nice value of the writing threads where SCHED_IDLE is missing


class ServingFirst:
    def __init__(self, busy: Callable[[], bool], busy_bytes_per_s: float, wait: Callable[[float], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`busy()`: whether requests run now; `wait(seconds)`: sleeps, and returns early when the write is
        stopped (a threading.Event's wait)."""
        self.busy, self.rate, self.wait, self.clock = busy, busy_bytes_per_s, wait, clock
        self.paced_s = 0.0  # time the write spent yielding
        self._lock = threading.Lock()  # while busy, one piece at a time
        self._next = 0.0  # when the next piece may start, at the busy rate
        self._lowered: set[int] = set()

    def __call__(self, size: int) -> None:
        """Before a piece of `size` bytes, on the writing thread."""
        self._lower_priority()
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

    def _lower_priority(self) -> None:
        thread = threading.get_native_id()
        if thread in self._lowered:
            return
        self._lowered.add(thread)
        try:  # Linux: a thread id names the thread alone
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            try:  # no SCHED_IDLE: the lowest nice value
                os.setpriority(os.PRIO_PROCESS, thread, LOWEST_PRIORITY)
            except (OSError, AttributeError):
                pass  # elsewhere, or not permitted: the pace alone
