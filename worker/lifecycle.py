"""Idle tracking, parking and draining: what a serverless worker does between and after requests.

- Idle: seconds since the last request finished while none is in flight; shown in /ready and /idle,
  and reported to an inactivity controller (GLMFLASH_CONTROLLER_URL) every few seconds.
- Park: after GLMFLASH_IDLE_TIMEOUT_S of idleness, stop taking work and ask the server to exit
  cleanly (the prepared snapshot on the volume is what the next fast resume needs; the GPU is freed
  when the process ends).
- Drain (SIGTERM): stop admitting (503), let in-flight requests finish within the grace period,
  abort what is left after it, then let the server exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp

log = logging.getLogger("glmflash.lifecycle")
REPORT_EVERY_S = 5.0


class Lifecycle:
    def __init__(self, in_flight: Callable[[], int], idle_timeout_s: float = 0.0,
                 controller_url: str | None = None, worker_id: str = "glmflash") -> None:
        self.in_flight = in_flight
        self.idle_timeout_s, self.controller_url, self.worker_id = idle_timeout_s, controller_url, worker_id
        self.last_active = time.monotonic()
        self.stop_reason: str | None = None

    def touch(self) -> None:
        """Called when a request starts or finishes."""
        self.last_active = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self.in_flight() else time.monotonic() - self.last_active

    def snapshot(self) -> dict:
        return {"in_flight": self.in_flight(), "idle_s": round(self.idle_seconds(), 3),
                "idle_timeout_s": self.idle_timeout_s}

    async def watch(self, stop: asyncio.Event, stage: Callable[[], str]) -> None:
        """Report idleness and set `stop` (reason "idle") once the idle timeout passes."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            next_report = 0.0
            while not stop.is_set():
                now = time.monotonic()
                if self.controller_url and now >= next_report:
                    await self._report(session, stage())
                    next_report = now + REPORT_EVERY_S
                if self.idle_timeout_s and self.idle_seconds() >= self.idle_timeout_s:
                    log.info("event=park reason=idle idle_s=%.1f", self.idle_seconds())
                    self.stop_reason = "idle"
                    stop.set()
                    if self.controller_url:
                        await self._report(session, "parked")
                    return
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass

    async def _report(self, session: aiohttp.ClientSession, stage: str) -> None:
        body = {"worker_id": self.worker_id, "stage": stage, **self.snapshot()}
        try:
            async with session.post(self.controller_url, json=body) as response:
                response.release()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("event=controller_report_failed url=%s error=%s", self.controller_url, exc)

    async def drain(self, grace_s: float, abort_all: Callable[[], None]) -> int:
        """Wait up to grace_s for in-flight requests; abort the rest. Returns how many were aborted."""
        deadline = time.monotonic() + grace_s
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if left:
            log.warning("event=drain_timeout aborted=%d grace_s=%.1f", left, grace_s)
            abort_all()
        return left
