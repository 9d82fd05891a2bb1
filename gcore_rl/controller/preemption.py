"""Preemption: SIGTERM (what Slurm, Kubernetes and spot instances send before they kill a job) stops the run
at the next step boundary with a complete checkpoint, and the job exits with status 143.

A controller that receives SIGTERM only notes when (`PreemptionWatch`); a Ray job's driver, which is what
receives SIGTERM there (its controllers are actors and leave signals to Ray), writes `OUTPUT_DIR/preempt-requested`
instead (`request_preemption`). At the end of each step every controller asks whether any of them was told
(`requested`: the signal or the file, one small all-reduce when there are several), so all stop after the same
step. The loop then saves that step's checkpoint (unless it just did), waits until it
is complete and raises `Preempted`, which the driver never restarts and the command line turns into exit
status 143. `run.resume=auto` then continues from that checkpoint to the same record an uninterrupted run
writes. If the checkpoint is not complete `run.preempt_grace_s` seconds after the signal, the process
exits 143 there and then, with no new checkpoint (an unfinished save is never taken by a resume): the
machine's own kill would come soon after.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gcore_rl.distributed import DistInfo, all_reduce_mean
from gcore_rl.errors import EXIT_PREEMPTED, Preempted

__all__ = ["EXIT_PREEMPTED", "REQUEST_FILE", "Preempted", "PreemptionWatch", "clear_preemption", "request_preemption"]


REQUEST_FILE = "preempt-requested"
"""The file in the run's output folder by which a Ray job's driver asks its controllers to stop (`request_preemption`)."""


def request_preemption(output_dir: str | Path) -> None:
    """Ask the run writing `output_dir` to stop at its next step boundary with a checkpoint (the driver of a Ray job)."""
    (Path(output_dir) / REQUEST_FILE).write_text(f"{time.time():.3f}\n")


def clear_preemption(output_dir: str | Path) -> None:
    """Forget an earlier run's request (a run that resumes after a preemption starts without one)."""
    (Path(output_dir) / REQUEST_FILE).unlink(missing_ok=True)


class PreemptionWatch:
    """Notes SIGTERM in this process (while open; in the main thread of a process that `handles_signals`) or the
    driver's request file, and enforces the grace period where it handles the signal."""

    def __init__(self, grace_s: float, output_dir: str | Path, handles_signals: bool = True,
                 on_signal: Callable[[], None] | None = None):
        """`on_signal()` is called once the signal has come (a Ray job's driver: `request_preemption`)."""
        self.grace_s = grace_s
        self.on_signal = on_signal
        self.request = Path(output_dir) / REQUEST_FILE
        self.received_at: float | None = None
        self._timer: threading.Timer | None = None
        self._previous = None
        if handles_signals and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.received_at is not None:
            return  # the signal came twice (to the process group and forwarded by the driver)
        self.received_at = time.monotonic()
        print(f"SIGTERM: stopping after this step with a checkpoint (within run.preempt_grace_s={self.grace_s:g} s)",
              file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace_s, _exit_without_checkpoint, args=(self.grace_s,))
        self._timer.daemon = True
        self._timer.start()
        if self.on_signal is not None:
            self.on_signal()

    def requested(self, info: DistInfo) -> bool:
        """Whether any controller received SIGTERM (a collective when there are several: call it at the same
        point of every step on every controller)."""
        told = 1.0 if self.received_at is not None or self.request.exists() else 0.0
        if info.world_size > 1:
            told = all_reduce_mean({"preempt_max": told}, info.device)["preempt_max"]
        return told > 0

    def __enter__(self) -> PreemptionWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the grace timer and give SIGTERM back to its previous handler."""
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _exit_without_checkpoint(grace_s: float) -> None:
    print(f"SIGTERM: no checkpoint was complete within run.preempt_grace_s={grace_s:g} s; exiting without one "
          "(run.resume=auto continues from the newest complete checkpoint)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PREEMPTED)
