"""A controller's records of its run, beside the checkpoints: metrics and loggers, timeline, prompt rows,
length splits."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from gcore_rl.config import JobConfig
from gcore_rl.configlib import to_dict
from gcore_rl.disk import writing
from gcore_rl.distributed import DistInfo
from gcore_rl.telemetry.loggers import open_loggers
from gcore_rl.telemetry.metrics import PhaseTimer
from gcore_rl.telemetry.timeline import CONTROLLER_ROLE_OF_PHASE, TimelineRecorder


class ControllerLog:
    """A controller's records: its timeline (`timeline/controller-<i>.jsonl`), the phase timer that
    feeds it, the prompt rows of each step (`prompts/controller-<i>.jsonl`), the trained rows' lengths
    (`lengths/controller-<i>.jsonl`), and on controller 0
    the run's `metrics.jsonl` and the other `run.loggers`."""

    def __init__(self, out: Path, info: DistInfo, cfg: JobConfig, first_step: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.out = out
        self.writer = (open_loggers(cfg.run.loggers, out, config=to_dict(cfg), key="run.loggers", first_step=first_step)
                       if info.is_main else None)  # first: a logger that fails to open leaves no file open
        self.timeline = TimelineRecorder(info.rank, out / "timeline" / f"controller-{info.rank}.jsonl",
                                         roles=CONTROLLER_ROLE_OF_PHASE, owner="controller")
        self.timer = PhaseTimer(on_span=self.timeline.record, clock=clock)
        prompts = out / "prompts" / f"controller-{info.rank}.jsonl"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        self.prompts = prompts.open("a", encoding="utf-8")
        splits = out / "lengths" / f"controller-{info.rank}.jsonl"
        splits.parent.mkdir(parents=True, exist_ok=True)
        self.splits = splits.open("a", encoding="utf-8")

    def begin_step(self, step: int) -> None:
        self.timer.reset()
        self.timeline.begin_step(step)

    def write(self, step: int, metrics: dict[str, float], row_ids: list[int], split: dict | None = None) -> None:
        """Record the step: its metrics (controller 0), the global prompt rows this controller drew for it, and
        how its trained rows were split over its trainers (`SliceClient.split`: each row's tokens and the
        number of trainer groups, in `lengths/controller-<i>.jsonl`: what `gcore-rl simulate --calibrate`
        replays through the simulator's split)."""
        with writing(self.out, "the run's records"):
            if self.writer is not None:
                self.writer.write(step, metrics)
            self.prompts.write(json.dumps({"step": step, "rows": row_ids}) + "\n")
            self.prompts.flush()
            if split:
                self.splits.write(json.dumps({"step": step, **split}) + "\n")
                self.splits.flush()

    def close(self) -> None:
        self.timeline.close()
        self.prompts.close()
        self.splits.close()
        if self.writer is not None:
            self.writer.close()
