"""Which routed experts are in their final place yet, while a background fill loads them (early readiness).

With early readiness the non-expert weights are loaded first and the expert stacks are allocated in
their final places, then filled in units: a run of one expert's tensors in the checkpoint, or a
verified piece of the prepared snapshot. A unit covers some (layer, expert) pairs; an expert is usable
once every unit touching it has landed. Each unit is claimed by exactly one loader (the background
fill, or a step that needs one of its experts now) while the other waits for it, so no byte is copied
twice and nothing reads an expert half-written.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

log = logging.getLogger("glmflash.engine")

PENDING, LOADING, LOADED = "pending", "loading", "loaded"
# Units a step loads at once when it needs experts the fill has not reached: one at a time, a short prompt's
# first layer (tens of experts, ~13.5 MB each at the release's shapes) waited on one read after another
# (~6 s of a 20 GB slice's early-readiness start on an H200); several keep the disk busy.
ON_DEMAND_WORKERS = 4


@dataclass(frozen=True)
class ExpertUnit:
    """One read of the fill: `load()` puts its bytes in place; `experts` are the (layer, expert) pairs it
    holds bytes of (all or part); `nbytes` is what it reads."""

    load: Callable[[], None]
    experts: tuple[tuple[int, int], ...]
    nbytes: int


class ExpertAvailability:
    def __init__(self, units: list[ExpertUnit], layers: Iterable[int], num_experts: int) -> None:
        self.units = units
        self._state = [PENDING] * len(units)
        self._cv = threading.Condition()
        self._units_of: dict[tuple[int, int], list[int]] = {}
        for i, unit in enumerate(units):
            for pair in unit.experts:
                self._units_of.setdefault(pair, []).append(i)
        self._left = {pair: len(ids) for pair, ids in self._units_of.items()}
        # Read without the lock by executors: flags only ever go from False to True.
        self.loaded = {layer: torch.zeros(num_experts, dtype=torch.bool) for layer in layers}
        for layer, flags in self.loaded.items():  # experts no unit holds bytes of (none expected) count as loaded
            for e in range(num_experts):
                flags[e] = (layer, e) not in self._units_of
        self.total_bytes = sum(u.nbytes for u in units)
        self.loaded_bytes = 0
        self.on_demand_units = 0
        self.done = threading.Event()
        self._on_demand: ThreadPoolExecutor | None = None  # made at the first on-demand load
        self.fill_error: BaseException | None = None  # what ended a `start`ed fill early (its owner shows it)
        if not units:
            self.done.set()

    @property
    def share(self) -> float:
        """Fraction of the expert bytes in place."""
        return self.loaded_bytes / self.total_bytes if self.total_bytes else 1.0

    @property
    def complete(self) -> bool:
        return self.done.is_set()

    def ensure(self, layer: int, experts: Iterable[int]) -> None:
        """Load now whichever of these experts of `layer` are not in place (waiting on units another thread
        is loading); returns once all of them are usable."""
        flags = self.loaded[layer]
        wanted = sorted({u for e in experts if not flags[e] for u in self._units_of[(layer, e)]})
        if len(wanted) > 1:
            with self._cv:
                if self._on_demand is None:
                    self._on_demand = ThreadPoolExecutor(ON_DEMAND_WORKERS, thread_name_prefix="glmflash-expert-now")
                pool = self._on_demand
            loads = [pool.submit(self._load, i) for i in wanted]
            wait(loads)  # all of them end before an error is raised: none is left writing behind the step
            done = [future.result() for future in loads]
        else:
            done = [self._load(i) for i in wanted]
        with self._cv:
            self.on_demand_units += sum(done)
        if self.complete:
            self._release_on_demand()

    def _release_on_demand(self) -> None:
        """Once every unit is in: the on-demand threads end (and their staging buffers with them)."""
        with self._cv:
            pool, self._on_demand = self._on_demand, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _load(self, i: int) -> bool:
        """Load unit `i` unless it is loaded; True if this call did it."""
        with self._cv:
            while self._state[i] == LOADING:
                self._cv.wait()
            if self._state[i] == LOADED:
                return False
            self._state[i] = LOADING
        try:
            self.units[i].load()
        except BaseException:
            with self._cv:
                self._state[i] = PENDING  # a later caller tries again (and sees the error itself)
                self._cv.notify_all()
            raise
        with self._cv:
            self._state[i] = LOADED
            self.loaded_bytes += self.units[i].nbytes
            for pair in self.units[i].experts:
                self._left[pair] -= 1
                if not self._left[pair]:
                    self.loaded[pair[0]][pair[1]] = True
            if all(s == LOADED for s in self._state):
                self.done.set()
            self._cv.notify_all()
        return True

    def fill(self, workers: int = 1, gb_per_s: float | None = None, stop: threading.Event | None = None) -> None:
        """Load every unit not loaded yet, in order, `workers` at a time. `gb_per_s` caps the fill's read rate
        (so it leaves the disk to others; also what makes a slow fill reproducible); `stop` abandons it."""
        start = time.perf_counter()
        lock, paced = threading.Lock(), [0]

        def run(i: int) -> None:
            if stop is not None and stop.is_set() or self._state[i] == LOADED:
                return
            if gb_per_s:
                with lock:
                    due, paced[0] = start + paced[0] / (gb_per_s * 1e9), paced[0] + self.units[i].nbytes
                time.sleep(max(0.0, due - time.perf_counter()))
            self._load(i)

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="glmflash-expert-fill") as pool:
            for future in [pool.submit(run, i) for i in range(len(self.units))]:
                future.result()
        if self.complete:
            self._release_on_demand()
            seconds = time.perf_counter() - start
            log.info("event=experts_loaded seconds=%.2f bytes=%d gb_s=%.3f on_demand_units=%d units=%d", seconds,
                     self.total_bytes, self.total_bytes / seconds / 1e9 if seconds else 0.0, self.on_demand_units,
                     len(self.units))

    def start(self, workers: int = 1, gb_per_s: float | None = None,
              on_done: Callable[[BaseException | None], None] = lambda error: None) -> threading.Event:
        """Run `fill` on a thread of its own; `on_done(error or None)` once it ends. Returns its stop event."""
        stop = threading.Event()

        def run() -> None:
            try:
                self.fill(workers, gb_per_s, stop)
            except BaseException as exc:  # reported to the owner; steps needing those experts retry and fail
                self.fill_error = exc
                log.error("event=experts_loaded state=failed error=%r", exc)
                on_done(exc)
                return
            on_done(None)

        threading.Thread(target=run, name="glmflash-expert-fill", daemon=True).start()
        return stop
