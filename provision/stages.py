"""Stage markers: one `PROVISION_STAGE=<name> elapsed_s=... budget_left_s=...` line per step of a start.

The chosen path is itself a stage (`cold` or `fast_resume`), followed by its steps (download,
verify, repair, prepare, load, warmup, ready). The current stage and progress feed /ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

@dataclass
class StageClock:
    budget_s: float
    start: float = field(default_factory=time.monotonic)
    name: str = "starting"
    detail: dict = field(default_factory=dict)
    history: list[tuple[str, float]] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def stage(self, name: str, **detail) -> None:
        self.name, self.detail = name, dict(detail)
        self.history.append((name, round(self.elapsed_s, 3)))
        extra = "".join(f" {k}={v}" for k, v in detail.items())
        line = f"PROVISION_STAGE={name} elapsed_s={self.elapsed_s:.2f} budget_left_s={self.budget_s - self.elapsed_s:.2f}"
        print(line + extra, flush=True)

    def progress(self, **detail) -> None:
        """Update what /ready shows inside the current stage (bytes done, files left...) without a new line."""
        self.detail.update(detail)

    def status(self) -> dict:
        return {"stage": self.name, "elapsed_s": round(self.elapsed_s, 3),
                "budget_left_s": round(self.budget_s - self.elapsed_s, 3), **self.detail,
                "stages": [{"stage": n, "at_s": t} for n, t in self.history]}
