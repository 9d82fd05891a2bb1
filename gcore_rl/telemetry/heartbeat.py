"""Heartbeats: each process of a job says, in a small file, which phase it last finished and when.

A process that times its phases with a `PhaseTimer` passes `Heartbeat.record` on as (part of) the
timer's `on_span`; every finished phase then rewrites ``OUTPUT_DIR/heartbeat/<process>.json`` as
``{"process", "pid", "step", "phase", "time"}`` (Unix-epoch seconds, so every process on every node
shares one clock). The file is replaced atomically, so a reader never sees half a beat. A phase that
repeats quickly (a rollout engine's stream ends one `rollout/generate` span per decoding round) is
written at most once every `BEAT_INTERVAL_S`; a different phase or step is written at once, so the
file always names the last phase that ended. The runtime's watchdog (`runtime/healing.py`) reads
these files to tell a hang from a long phase.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"
BEAT_INTERVAL_S = 1.0
"""Longest a repeated phase's beat may be held back; a reader allows this much on top of its timeout."""


@dataclass(frozen=True)
class Beat:
    """One process's last finished phase."""

    process: str
    pid: int
    step: int
    phase: str
    time: float


class Heartbeat:
    """Writes `process`'s beats into ``output_dir/heartbeat/<process>.json`` (see the module docstring)."""

    def __init__(self, output_dir: str | Path, process: str):
        self.path = Path(output_dir) / HEARTBEAT_DIR / f"{process}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.step = 0
        self._written: tuple[int, str, float] | None = None  # (step, phase, time) of the last write

    def begin_step(self, step: int) -> None:
        self.step = step

    def record(self, phase: str, start: float, end: float) -> None:
        """A `PhaseTimer` `on_span` callback: `phase` has just ended (its span's times are not used)."""
        now = time.time()
        last = self._written
        if last is not None and last[:2] == (self.step, phase) and now - last[2] < BEAT_INTERVAL_S:
            return
        beat = Beat(process=self.process, pid=os.getpid(), step=self.step, phase=phase, time=now)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(vars(beat)))
        tmp.replace(self.path)
        self._written = (self.step, phase, now)


def read_beats(output_dir: str | Path) -> list[Beat]:
    """Every process's last beat in `output_dir` (files that vanish or do not parse are skipped)."""
    beats = []
    for path in sorted((Path(output_dir) / HEARTBEAT_DIR).glob("*.json")):
        try:
            beats.append(Beat(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return beats
