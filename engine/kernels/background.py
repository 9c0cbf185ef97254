"""One background job per key and process: a loader starts a warm-up as soon as it knows the shapes, and
the engine, built later, waits on the same future instead of starting the work again."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable


class OncePerKey:
    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._jobs: dict[Hashable, Future] = {}
        self._lock = threading.Lock()

    def started(self, key: Hashable) -> Future | None:
        with self._lock:
            return self._jobs.get(key)

    def start(self, key: Hashable, job: Callable[[], Any]) -> Future:
        """`job` on a thread of its own, unless one was started for `key` already -> that job's future."""
        with self._lock:
            if key not in self._jobs:
                pool = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
                self._jobs[key] = pool.submit(job)
                pool.shutdown(wait=False)  # the thread ends with its one job
            return self._jobs[key]
