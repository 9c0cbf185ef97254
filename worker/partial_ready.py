"""ready_at=partial seen from the worker: the background expert fill, and what waits for its end.

The server is ready once the non-expert weights are in; the routed experts fill in on a thread of
their own (`GLMFLASH_EXPERT_FILL_GBPS` caps its rate) while steps load the ones they need first.
Vast hears a reduced max_perf meanwhile: the full figure cached by an earlier start, scaled by the
share of expert bytes in place (at least MIN_SHARE: each request still loads what it needs); with no
figure cached, `loaded` waits for the fill and the benchmark. When the fill ends, the prepared
snapshot write starts (it reads every expert) and Vast gets the full figure.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from engine.loading import ExpertAvailability

log = logging.getLogger("glmflash.worker")
MIN_SHARE = 0.1


def reduced_max_perf(full: float, share: float) -> float:
    return full * max(share, MIN_SHARE)


class ExpertFill:
    """Runs an availability's fill in the background; `finished` resolves (in the event loop) with None or
    the error that ended it."""

    def __init__(self, experts: ExpertAvailability, workers: int, gb_per_s: float | None) -> None:
        self.experts, self.workers, self.gb_per_s = experts, workers, gb_per_s
        self.finished: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop: threading.Event | None = None

    def start(self) -> None:
        loop = self.finished.get_loop()

        def done(error: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(lambda: self.finished.done() or self.finished.set_result(error))
            except RuntimeError:  # the server stopped first: its loop is closed, nobody waits
                pass

        self._stop = self.experts.start(self.workers, self.gb_per_s, done)

    def stop(self) -> None:
        """Abandon the fill (shutdown); units already being read finish."""
        if self._stop is not None:
            self._stop.set()
