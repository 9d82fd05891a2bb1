"""The simulated per-device timeline and the utilisation derived from it.

Events have the same fields as the trainer's own timelines (`gcore_rl.telemetry.timeline`):
(step, device, role, what, start, end), in simulated seconds from the job's start. The simulator
adds them in vectorised chunks (one role and phase, many devices and intervals at once), so a
512-device job records without a Python loop per device; `events()` expands chunks on demand.

Roles: `rollout` (policy engine generating), `judge` (generative reward model scoring),
`reference` (reference log-prob pass outside the update phase, `interleave`), `actor` (prepare +
train), `sync` (weight sync), `swap` (an engine or the trainer moving memory to or from the host),
`data` (waiting while the controller ships payload), and `idle` (everything else).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROLES = ("rollout", "judge", "reference", "actor", "sync", "swap", "data", "idle")


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one device."""

    step: int
    device: int
    role: str
    what: str
    start: float
    end: float


@dataclass(frozen=True)
class _Chunk:
    role: str
    what: str
    step: int
    device: np.ndarray
    start: np.ndarray
    end: np.ndarray


class Timeline:
    """Intervals of every device, stored in chunks."""

    def __init__(self, devices: int):
        self.devices = devices
        self._chunks: list[_Chunk] = []

    def add(self, role: str, what: str, step: int, device, start, end) -> None:
        """Record intervals [start, end) of `role`/`what`; arguments broadcast together (arrays or scalars)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        device, start, end = np.broadcast_arrays(np.asarray(device, np.int64), np.asarray(start, np.float64),
                                                 np.asarray(end, np.float64))
        keep = end > start
        if keep.any():
            self._chunks.append(_Chunk(role, what, step, device[keep].ravel(), start[keep].ravel(), end[keep].ravel()))

    @property
    def end(self) -> float:
        """The last moment any device is busy."""
        return max((float(ch.end.max()) for ch in self._chunks), default=0.0)

    def busy_seconds(self) -> dict[str, float]:
        """Device-seconds of each role (idle = devices x end - the rest)."""
        totals = dict.fromkeys(ROLES, 0.0)
        for ch in self._chunks:
            totals[ch.role] += float((ch.end - ch.start).sum())
        totals["idle"] = max(0.0, self.devices * self.end - sum(totals.values()))
        return totals

    def utilisation(self) -> dict[str, float]:
        """Share of all device-time spent in each role (sums to 1)."""
        busy = self.busy_seconds()
        whole = self.devices * self.end
        return {role: (seconds / whole if whole > 0 else 0.0) for role, seconds in busy.items()}

    def device_seconds(self, role: str) -> np.ndarray:
        """[devices] seconds each device spent in `role`."""
        out = np.zeros(self.devices)
        for ch in self._chunks:
            if ch.role == role:
                np.add.at(out, ch.device, ch.end - ch.start)
        return out

    def events(self, devices: range | None = None, until: float | None = None) -> list[TimelineEvent]:
        """Events of the given devices (all by default) that start before `until`, sorted by device and time."""
        out: list[TimelineEvent] = []
        for ch in self._chunks:
            keep = np.ones(len(ch.device), bool)
            if devices is not None:
                keep &= (ch.device >= devices.start) & (ch.device < devices.stop)
            if until is not None:
                keep &= ch.start < until
            for d, s, e in zip(ch.device[keep], ch.start[keep], ch.end[keep], strict=True):
                out.append(TimelineEvent(ch.step, int(d), ch.role, ch.what, float(s), float(e)))
        out.sort(key=lambda ev: (ev.device, ev.start, ev.end))
        return out
