"""Per-device, per-role timeline events and the utilisation figures derived from them.

Every device worker records what its device did in each step: which role was busy with what,
how long engines took to release and reload memory (swap), and (from the totals) how long the
device sat idle. Events go to `timeline/device-<d>.jsonl` in the run directory as `{"step",
"device", "role", "what", "start", "end"}` lines (Unix-epoch seconds, so the timelines of all
processes share one clock), from which a report can draw a Gantt chart. Controllers write `timeline/controller-<k>.jsonl` the same way for their
own work (rule rewards, waiting for the other controllers). The per-step totals go to
`metrics.jsonl` as `util/...` keys, which is what a rebalancer reads.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path

#: which role occupies a device during each timed phase of a device worker; a reward model's phase
#: ``rollout/<kind>`` is its role's (`device_roles`)
ROLE_OF_PHASE = {
    "rollout/generate": "rollout",
    "rollout/reference": "reference",
    "rollout/load_weights": "rollout",
    "update/prepare": "actor",
    "update/train": "actor",
    "update/sync": "actor",
    "update/critic_values": "critic",
    "update/critic": "critic",
    "swap/sleep": "swap",
    "swap/wake": "swap",
}



def device_roles(reward_roles: Iterable[str]) -> dict[str, str]:
    """`ROLE_OF_PHASE` with the phase ``rollout/<role>`` of each reward model's role (``judge``, ``reward_model``)."""
    return {**ROLE_OF_PHASE, **{f"rollout/{role}": role for role in reward_roles}}


#: what a controller itself spends time on (rule rewards run in the controller process)
CONTROLLER_ROLE_OF_PHASE = {
    "rollout/reward": "rewards",
    "rollout/wait": "wait",
}


class TimelineRecorder:
    """Collects the spans of one device (or controller); pass `record` as a `PhaseTimer` `on_span` callback.

    `roles` maps the phases worth recording to roles; `owner` names the event field that holds
    `device` ("device", or "controller" for a controller's own timeline).
    """

    def __init__(self, device: int, path: Path | None, roles: dict[str, str] | None = None, owner: str = "device"):
        self.device = device
        self.roles = ROLE_OF_PHASE if roles is None else roles
        self.owner = owner
        self.step = 0
        # events carry wall-clock (Unix epoch) seconds so timelines of different processes line up
        self._offset = time.time() - time.perf_counter()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        self._busy: dict[str, float] = {}
        self._lock = threading.Lock()  # a controller's rollout producer records from a thread of its own

    def begin_step(self, step: int) -> None:
        with self._lock:
            self.step = step
            self._busy = {}
            if self._file is not None:
                self._file.flush()  # the earlier steps' events become readable (a report drawn during the run)

    def record(self, phase: str, start: float, end: float) -> None:
        role = self.roles.get(phase)
        if role is None:
            return
        with self._lock:
            self._busy[role] = self._busy.get(role, 0.0) + (end - start)
            if self._file is not None:
                event = {"step": self.step, self.owner: self.device, "role": role, "what": phase,
                         "start": round(start + self._offset, 6), "end": round(end + self._offset, 6)}
                self._file.write(json.dumps(event) + "\n")

    def busy_seconds(self) -> dict[str, float]:
        """Seconds per role recorded so far in the current step."""
        with self._lock:
            return dict(self._busy)

    def utilisation(self, step_seconds: float) -> dict[str, float]:
        """`util/<role>/busy_s`, `util/wait_s`, `util/idle_s` and the busy fraction of this step."""
        return utilisation(self.busy_seconds(), step_seconds)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def utilisation(busy_by_role: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Split one step's wall time into busy time per role, swapping, waiting and idle (the remainder).

    `busy_by_role` holds seconds per role, with waiting for other controllers under "wait" and
    engines releasing / reloading memory under "swap".
    """
    wait = busy_by_role.get("wait", 0.0)
    swap = busy_by_role.get("swap", 0.0)
    busy = {role: s for role, s in busy_by_role.items() if role not in ("wait", "swap")}
    total_busy = sum(busy.values())
    metrics = {f"util/{role}/busy_s": seconds for role, seconds in busy.items()}
    metrics["util/wait_s"] = wait
    metrics["util/swap_s"] = swap
    metrics["util/idle_s"] = max(step_seconds - total_busy - wait - swap, 0.0)
    metrics["util/busy_fraction"] = total_busy / step_seconds if step_seconds > 0 else 0.0
    return metrics
