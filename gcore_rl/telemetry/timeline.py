"""Per-device, per-role timeline events and the utilisation figures derived from them.

Every controller records what its device did in each step: which role was busy with what, how
long it waited for the other controllers, and (from the totals) how long it sat idle. Events go
to `timeline/device-<d>.jsonl` in the run directory as `{"step", "device", "role", "what",
"start", "end"}` lines (seconds since the controller started), so a report can draw a Gantt chart;
the per-step totals go to `metrics.jsonl` as `util/...` keys, which is what a rebalancer reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

#: which role occupies the device during each timed phase of the controller program
ROLE_OF_PHASE = {
    "rollout/generate": "rollout",
    "rollout/reward": "rewards",
    "rollout/judge": "judge",
    "rollout/wait": "wait",
    "update/prepare": "actor",
    "update/train": "actor",
    "update/sync": "actor",
}


class TimelineRecorder:
    """Collects the spans of one device; pass `record` as a `PhaseTimer` `on_span` callback."""

    def __init__(self, device: int, path: Path | None):
        self.device = device
        self.step = 0
        self._origin = time.perf_counter()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        self._busy: dict[str, float] = {}

    def begin_step(self, step: int) -> None:
        self.step = step
        self._busy = {}

    def record(self, phase: str, start: float, end: float) -> None:
        role = ROLE_OF_PHASE.get(phase)
        if role is None:
            return
        self._busy[role] = self._busy.get(role, 0.0) + (end - start)
        if self._file is not None:
            event = {"step": self.step, "device": self.device, "role": role, "what": phase,
                     "start": round(start - self._origin, 6), "end": round(end - self._origin, 6)}
            self._file.write(json.dumps(event) + "\n")

    def utilisation(self, step_seconds: float) -> dict[str, float]:
        """`util/<role>/busy_s`, `util/wait_s`, `util/idle_s` and the busy fraction of this step."""
        return utilisation(self._busy, step_seconds)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def utilisation(busy_by_role: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Split one step's wall time into busy time per role, waiting and idle (the remainder).

    `busy_by_role` holds seconds per role, with waiting for other controllers under "wait".
    """
    wait = busy_by_role.get("wait", 0.0)
    busy = {role: s for role, s in busy_by_role.items() if role != "wait"}
    total_busy = sum(busy.values())
    metrics = {f"util/{role}/busy_s": seconds for role, seconds in busy.items()}
    metrics["util/wait_s"] = wait
    metrics["util/idle_s"] = max(step_seconds - total_busy - wait, 0.0)
    metrics["util/busy_fraction"] = total_busy / step_seconds if step_seconds > 0 else 0.0
    return metrics
