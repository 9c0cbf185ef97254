"""The PCIe share of decode misses, following the rate the CPU's passes reach inside the steps.

The split starts from rates measured at load (offload/miss_split.py): a few experts alone, where the passes ran
25% faster than inside the steps on the H200's host (98 against 74 GB/s), and the CPU then held the step while
the link waited. Every FOLLOW_STEPS decode steps the host steps' totals give the CPU's rate over that window,
and the share moves halfway to where that rate and the link's measured one make both sides take as long.
"""

from __future__ import annotations

import logging
from collections import deque

from engine.offload import miss_split

log = logging.getLogger("glmflash.engine")
FOLLOW_STEPS = 8  # decode steps between two looks at the CPU's rate inside them (the miss split follows it)
# The split follows the highest of the last FOLLOW_WINDOWS windows' CPU rates (the load's measurement first): a
# window whose steps were not back to back (the CPU threads asleep between them, a capture, a compile) reads a
# rate far below the pass's own (6 GB/s once after a start, where the passes ran 60-74), and sent the split
# from 58 to 73% before it came back down.
FOLLOW_WINDOWS = 4

HostTotals = tuple[int, float, int]  # since start: decode steps the host steps ran, seconds of CPU passes, bytes read


class SplitFollower:
    """Looks at the host steps' totals every `steps` decode steps and names the share their CPU rate asks for."""

    def __init__(self, steps: int = FOLLOW_STEPS, windows: int = FOLLOW_WINDOWS) -> None:
        self.steps = steps
        self._followed: HostTotals | None = None  # the totals last looked at (None: not yet)
        self._calls = 0  # `due` calls since the totals were last read
        self._cpu_rates: deque[float] = deque(maxlen=windows)  # the last windows' (B/s), the load's first

    def due(self) -> bool:
        """Called once a decode step: whether to read the totals now (reading them visits every host step's
        counters). The first call is due (it marks the end of the start's warm-up), then every `steps`-th."""
        self._calls += 1
        if self._followed is not None and self._calls < self.steps:
            return False
        self._calls = 0
        return True

    def follow(self, percent: int, totals: HostTotals, rates_at_load: tuple[float, float]) -> int | None:
        """The share to use from here (1-100) given the current one and the totals now, or None: at the first
        look (the steps so far were the start's warm-up: graph captures, dummy rows), after fewer than `steps`
        steps since the last window, or a window in which the CPU read nothing. Halfway to the target share: a
        pass's rate falls as its share shrinks (fixed costs), and a whole jump swung 41 -> 65 -> 78 -> 52%
        before settling at 44 on one machine."""
        if self._followed is None:
            self._followed = totals
            return None
        steps, seconds, nbytes = totals
        last_steps, last_seconds, last_bytes = self._followed
        if steps - last_steps < self.steps:
            return None
        self._followed = totals
        if seconds <= last_seconds or nbytes <= last_bytes:
            return None
        window = (nbytes - last_bytes) / (seconds - last_seconds)
        if not self._cpu_rates:
            self._cpu_rates.append(rates_at_load[0])
        self._cpu_rates.append(window)
        cpu = max(self._cpu_rates)
        target = miss_split.pcie_percent(cpu, rates_at_load[1])
        followed = min(100, max(1, round((percent + target) / 2)))
        if followed != percent:
            log.info("event=miss_split_followed window_cpu_GBps=%.1f cpu_GBps=%.1f pcie_GBps=%.1f pcie_percent=%d",
                     window / 1e9, cpu / 1e9, rates_at_load[1] / 1e9, followed)
        return followed
