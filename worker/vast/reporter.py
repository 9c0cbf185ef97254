"""What the autoscaler hears from this worker: `VastReporter` and the two messages it sends.

* **Status** (`metrics.py` `Metrics.__send_metrics_and_reset`): POST `{REPORT_ADDR}/worker_status/` with the fields
  of `data_types.WorkerStatusData`. The framework checks once a second and sends when an update is pending or 10 s
  went by, and does *not* mark an update pending when the model loads (a report lag of up to 10 s).
  `VastReporter` sends loaded / errored at once, then at most once a second while anything changed and every 10 s
  otherwise; counters are reduced by what a *delivered* report carried (nothing that happens during a send is lost);
  a failed send is retried with backoff and never raises into the server.
* **Finished requests** (`Metrics.__send_delete_requests_and_reset`): POST `{REPORT_ADDR}/delete_requests/` with
  `{worker_id, mtoken, requests: [{request_idx, success, status, entered_queue_at, work_started_at,
  work_completed_at}]}`; sent as soon as a request ends.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import aiohttp

from worker.vast.config import VastConfig

log = logging.getLogger("glmflash.vast")

PROTOCOL_VERSION = "1.1.0"  # backend.VERSION, reported as `version`
REDIS_REPORT_ADDR = "https://cloud.vast.ai/api/v0"  # metrics.py skips it for /delete_requests/
STATUS_BUSY_INTERVAL_S = 1.0  # metrics.py METRICS_UPDATE_INTERVAL
STATUS_IDLE_INTERVAL_S = 10.0
HTTP_TIMEOUT_S = 10.0  # metrics.py ClientTimeout(total=10)
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 10.0)


@dataclass(eq=False)
class RequestRecord:
    """One routed request (data_types.RequestMetrics, less the session fields)."""

    request_idx: int
    reqnum: int
    workload: float
    status: str = "Created"  # -> Started -> Success | Error | Cancelled | Rejected
    success: bool = False
    entered_queue_at: float = 0.0
    work_started_at: float = 0.0
    work_completed_at: float = 0.0
    verified: bool = False  # the router's signature was checked and held

    def delete_entry(self) -> dict[str, Any]:
        return {"request_idx": self.request_idx, "success": self.success, "status": self.status,
                "entered_queue_at": self.entered_queue_at, "work_started_at": self.work_started_at,
                "work_completed_at": self.work_completed_at}


def _disk_used_gb(path: str) -> float:
    return shutil.disk_usage(path).used / (2**30)  # psutil.disk_usage(...).used, in the framework


@dataclass
class _Counters:
    served: float = 0.0
    received: float = 0.0
    cancelled: float = 0.0
    errored: float = 0.0
    rejected: float = 0.0


class VastReporter:
    """The worker's state as the autoscaler sees it, and the two loops that tell it.

    Call from the event loop thread only. State changes are synchronous methods; `start()` runs the loops,
    `stop()` makes a last best-effort delivery and ends them.
    """

    def __init__(self, config: VastConfig, *, load_started_at: float | None = None, disk_path: str = "/",
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.disk_path = disk_path
        self.load_started_at = clock() if load_started_at is None else load_started_at
        self.loadtime: float | None = None
        self.max_perf = 0.0
        self.error_msg: str | None = None
        self.counters = _Counters()
        self.received_reqnums: set[int] = set()  # never cleared, as in the framework (num_requests_recieved)
        self.working: dict[int, RequestRecord] = {}
        self.deleting: list[RequestRecord] = []
        self.reports_sent = 0
        self._disk_reported = self._disk_now = _disk_used_gb(disk_path)
        self._seq = 0  # bumped on every change; a delivered report carries the seq it saw
        self._delivered_seq = -1
        self._urgent = False
        self._last_ok: float | None = None  # monotonic time of the last delivered report
        self._status_failures = self._delete_failures = 0
        self._status_retry_at = self._delete_retry_at = 0.0
        self._poke = asyncio.Event()
        self._deletes_ready = asyncio.Event()
        self._delivered = asyncio.Condition()
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False  # ends the loops even if a cancellation is swallowed (wait_for before 3.12)

    # state changes --------------------------------------------------------------------------------------------

    def _changed(self, urgent: bool = False) -> None:
        self._seq += 1
        self._urgent |= urgent
        self._poke.set()

    def model_loaded(self, max_perf: float) -> None:
        """Ready to serve, with the benchmark figure (units/s); reported at once."""
        self.loadtime = self.clock() - self.load_started_at
        self.max_perf = float(max_perf)
        log.info("event=vast_loaded max_perf=%.3f loadtime_s=%.2f", self.max_perf, self.loadtime)
        self._changed(urgent=True)

    def max_perf_changed(self, max_perf: float) -> None:
        """A new figure once loaded (early readiness: the full one once every expert is in); reported at once."""
        self.max_perf = float(max_perf)
        log.info("event=vast_max_perf max_perf=%.3f", self.max_perf)
        self._changed(urgent=True)

    def model_errored(self, message: str) -> None:
        """The worker cannot serve; reported at once (the autoscaler replaces it)."""
        self.error_msg = message
        log.error("event=vast_errored error=%s", message)
        self._changed(urgent=True)

    @property
    def loaded(self) -> bool:
        return self.loadtime is not None

    @property
    def cur_load(self) -> float:
        return float(sum(r.workload for r in self.working.values()))

    @property
    def wait_time(self) -> float:
        """Seconds the in-flight workload needs at max_perf (ModelMetrics.wait_time)."""
        return self.cur_load / max(self.max_perf, 0.00001) if self.working else 0.0

    def request_started(self, record: RequestRecord) -> None:
        record.status = "Started"
        record.work_started_at = record.work_started_at or self.clock()
        self.counters.received += record.workload
        self.received_reqnums.add(record.reqnum)
        self.working[id(record)] = record
        self._changed()

    def request_rejected(self, record: RequestRecord) -> None:
        """Refused before it started (bad signature, queue too long): rej_load, and deleted at the router."""
        record.status, record.success = "Rejected", False
        self.counters.rejected += record.workload
        self.received_reqnums.add(record.reqnum)
        self._finish(record)

    def request_finished(self, record: RequestRecord, status: str) -> None:
        """status: Success (cur_perf), Error, Cancelled (taken off new_load) or Rejected (rej_load)."""
        self.working.pop(id(record), None)
        record.status, record.success = status, status in ("Success", "Cancelled")
        if status == "Success":
            self.counters.served += record.workload
        elif status == "Cancelled":
            self.counters.cancelled += record.workload
        elif status == "Rejected":
            self.counters.rejected += record.workload
        else:
            self.counters.errored += record.workload
        self._finish(record)

    def _finish(self, record: RequestRecord) -> None:
        record.work_completed_at = self.clock()
        self.deleting.append(record)
        self._deletes_ready.set()
        self._changed()

    # messages -------------------------------------------------------------------------------------------------

    def status_payload(self) -> dict[str, Any]:
        """The `/worker_status/` body: data_types.WorkerStatusData's fields, in its order."""
        c = self.counters
        return {
            "id": self.config.container_id,
            "mtoken": self.config.mtoken,
            "version": PROTOCOL_VERSION,
            "loadtime": self.loadtime or 0.0,  # every report once loaded, as the framework sends it
            "cur_load": self.cur_load,
            "rej_load": c.rejected,
            "new_load": max(c.received - c.cancelled, 0.0),
            "error_msg": self.error_msg or "",
            "max_perf": self.max_perf,
            "cur_perf": c.served,
            "cur_capacity": 0,
            "max_capacity": 0,
            "num_requests_working": len(self.working),
            "num_requests_recieved": len(self.received_reqnums),
            "additional_disk_usage": self._disk_now - self._disk_reported,
            "disk_usage": self._disk_now,
            "working_request_idxs": [r.request_idx for r in self.working.values()],
            "url": self.config.url,
        }

    def delete_payload(self, records: list[RequestRecord]) -> dict[str, Any]:
        return {"worker_id": self.config.container_id, "mtoken": self.config.mtoken,
                "requests": [r.delete_entry() for r in records]}

    # delivery -------------------------------------------------------------------------------------------------

    async def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        return self._http

    async def _post(self, path: str, body: dict[str, Any], addrs: tuple[str, ...]) -> bool:
        """POST to the first report address that takes it (the framework's order); False if none did."""
        session = await self.http()
        for addr in addrs:
            try:
                async with session.post(addr.rstrip("/") + path, json=body) as response:
                    response.raise_for_status()
                return True
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("event=vast_report_failed path=%s addr=%s error=%r", path, addr, exc)
        return False

    async def send_status(self) -> bool:
        """One report now. On delivery the counters lose what it carried (changes made meanwhile stay)."""
        self._disk_now = _disk_used_gb(self.disk_path)
        body, seq, sent = self.status_payload(), self._seq, asdict(self.counters)
        urgent, self._urgent = self._urgent, False
        if not await self._post("/worker_status/", body, self.config.report_addrs):
            self._urgent |= urgent
            return False
        for name, value in sent.items():
            left = getattr(self.counters, name) - value
            setattr(self.counters, name, left if left > 1e-9 else 0.0)
        self._disk_reported = body["disk_usage"]
        self._delivered_seq = max(self._delivered_seq, seq)
        self._last_ok = time.monotonic()
        self.reports_sent += 1
        async with self._delivered:
            self._delivered.notify_all()
        return True

    async def send_deletes(self) -> bool:
        records = list(self.deleting)
        if not records:
            return True
        addrs = tuple(a for a in self.config.report_addrs if a != REDIS_REPORT_ADDR)
        if not addrs or not await self._post("/delete_requests/", self.delete_payload(records), addrs):
            return not addrs
        sent = {id(r) for r in records}
        self.deleting[:] = [r for r in self.deleting if id(r) not in sent]
        return True

    async def flush(self, timeout: float = HTTP_TIMEOUT_S) -> bool:
        """Wait until a report carrying every change made so far was delivered; False on timeout."""
        target = self._seq
        self._poke.set()

        async def delivered() -> None:
            async with self._delivered:
                await self._delivered.wait_for(lambda: self._delivered_seq >= target)

        try:
            await asyncio.wait_for(delivered(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _status_delay(self, now: float) -> float:
        if self._status_retry_at > now:
            return self._status_retry_at - now
        if self._urgent or self._last_ok is None:
            return 0.0
        pending = self._seq != self._delivered_seq
        return self._last_ok + (STATUS_BUSY_INTERVAL_S if pending else STATUS_IDLE_INTERVAL_S) - now

    async def _status_loop(self) -> None:
        while not self._stopping:
            self._poke.clear()
            delay = self._status_delay(time.monotonic())
            if delay > 0:
                try:
                    await asyncio.wait_for(self._poke.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                ok = await self.send_status()
            except Exception:  # never let reporting take the server down
                log.exception("event=vast_status_error")
                ok = False
            self._status_failures = 0 if ok else self._status_failures + 1
            self._status_retry_at = 0.0 if ok else time.monotonic() + _backoff(self._status_failures)

    async def _delete_loop(self) -> None:
        while not self._stopping:
            self._deletes_ready.clear()
            if not self.deleting:
                await self._deletes_ready.wait()
                continue
            wait = self._delete_retry_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                ok = await self.send_deletes()
            except Exception:
                log.exception("event=vast_delete_error")
                ok = False
            self._delete_failures = 0 if ok else self._delete_failures + 1
            self._delete_retry_at = 0.0 if ok else time.monotonic() + _backoff(self._delete_failures)

    def start(self) -> None:
        if not self._tasks:
            self._stopping = False
            self._tasks = [asyncio.create_task(self._status_loop(), name="vast-status"),
                           asyncio.create_task(self._delete_loop(), name="vast-delete-requests")]

    async def stop(self, timeout: float = 2.0) -> None:
        """End the loops after a last best-effort delivery of finished requests and counters."""
        self._stopping = True
        self._poke.set()
        self._deletes_ready.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        try:
            await asyncio.wait_for(asyncio.gather(self.send_deletes(), self.send_status()), timeout)
        except (asyncio.TimeoutError, Exception) as exc:
            log.warning("event=vast_final_report_failed error=%r", exc)
        if self._http is not None:
            await self._http.close()
            self._http = None


def _backoff(failures: int) -> float:
    return RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1]
