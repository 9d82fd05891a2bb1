"""Fault injection for tests of crash recovery: kill this process at a named point of a named step.

Set ``GCORE_FAULT=PHASE:STEP`` (e.g. ``train:3``) in a job's environment and the process that
reaches `PHASE` in step `STEP` first sends itself SIGKILL, the way an out-of-memory kill or a lost
node ends a process: no cleanup, no exception handler, files as they were at that instant. The
phases are ``generate`` (a rollout engine, after its first finished chunk), ``train`` (a trainer,
between prepare and update), ``sync`` (a trainer, halfway through the weight gather) and ``save``
(a controller, once the trainers' checkpoint writes have started and before the checkpoint is
complete). Unset, `maybe_fail` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "GCORE_FAULT"
PHASES = ("generate", "train", "sync", "save")


def maybe_fail(phase: str, step: int) -> None:
    """SIGKILL this process when ``GCORE_FAULT`` names `phase` and `step`."""
    spec = os.environ.get(ENV)
    if spec and spec == f"{phase}:{step}":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
