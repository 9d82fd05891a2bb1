"""Fault injection for tests of crash recovery: kill or hang this process at a named point of a named step.

Set ``GCORE_FAULT=PHASE:STEP`` (e.g. ``train:3``) in a job's environment and the process that
reaches `PHASE` in step `STEP` first sends itself SIGKILL, the way an out-of-memory kill or a lost
node ends a process: no cleanup, no exception handler, files as they were at that instant.
``GCORE_FAULT=hang-PHASE:STEP`` stops the process there instead, for good (it sleeps in a loop,
the way a deadlocked collective or a stuck device call looks from outside), which the runtimes'
hang detection (`runtime.phase_timeout_s`) must notice. ``GCORE_FAULT=nospace-PHASE:STEP`` raises the
`OSError` (`ENOSPC`) a write to a full disk raises (``nospace-save:N``: the controller's own checkpoint
files of step N, after the trainers wrote theirs), and ``GCORE_FAULT=oom-PHASE:STEP`` the `MemoryError` of an
allocation that finds no memory. The phases are ``generate`` (a rollout
engine, after its first finished chunk), ``score`` (a reward device, before it scores a batch),
``train`` (a trainer, between prepare and update), ``sync`` (a trainer, halfway through the weight
gather), ``save`` (a controller, once the trainers' checkpoint writes have started and before
the checkpoint is complete) and ``driver`` (the `gcore-rl` process itself, step 0, once the job's inputs are
checked and before its processes start). Unset, `maybe_fail` costs one dictionary lookup.

Once per job: a fault fires at most once when ``GCORE_FAULT_ONCE`` names a marker file (the
runtimes set it to `marker_path(output_dir)` for the processes they start, and the driver removes
the marker when a job starts): the first process to reach the fault creates the file and fires,
every later one (another trainer at the same point, the same process after a restart of the job
or of its actor) finds the file and goes on. Without it, every process that reaches the point
fires (the local runtime's single in-process controller, which no restart can heal anyway).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

ENV = "GCORE_FAULT"
ONCE_ENV = "GCORE_FAULT_ONCE"
PHASES = ("generate", "score", "train", "sync", "save", "driver")
HANG = "hang-"
"""Prefix of a phase that hangs instead of dying (``hang-train:2``)."""
NOSPACE = "nospace-"
"""Prefix of a phase that fails as a write to a full disk fails (``nospace-save:2``)."""
OOM = "oom-"
"""Prefix of a phase that fails as an allocation fails when memory runs out (``oom-train:2``: `MemoryError`)."""


def maybe_fail(phase: str, step: int) -> None:
    """SIGKILL this process when ``GCORE_FAULT`` names `phase` and `step`; hang it for good when it
    names ``hang-<phase>`` and `step`; raise ENOSPC for ``nospace-<phase>`` (each at most once per job with
    ``GCORE_FAULT_ONCE``)."""
    spec = os.environ.get(ENV)
    if not spec or spec not in [f"{kind}{phase}:{step}" for kind in ("", HANG, NOSPACE, OOM)] or not _first_to_fire(spec):
        return
    if spec.startswith(NOSPACE):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: {ENV}={spec})")
    if spec.startswith(OOM):
        raise MemoryError(f"injected: {ENV}={spec}")
    sys.stdout.flush()
    sys.stderr.flush()
    if spec.startswith(HANG):
        while True:  # a hang: only the watchdog's SIGUSR1 (stack dump) and the kill that follows end it
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def marker_path(output_dir: str | Path) -> Path:
    """The file that records, for the job writing `output_dir`, that its fault has fired."""
    return Path(output_dir) / "fault-fired"


def fired_at(output_dir: str | Path) -> float | None:
    """When the injected fault of the job writing `output_dir` fired (Unix seconds), or None when none fired
    there (no fault was injected: a real failure's moment is not known)."""
    try:
        text = marker_path(output_dir).read_text(encoding="utf-8")
    except OSError:
        return None
    _, found, moment = text.strip().rpartition(" at ")
    try:
        return float(moment) if found else None
    except ValueError:
        return None


def job_env(output_dir: str | Path) -> dict[str, str]:
    """The environment variables that carry this process's fault (if any) to the processes of a job,
    firing once per job; empty when no fault is set."""
    spec = os.environ.get(ENV)
    return {ENV: spec, ONCE_ENV: str(marker_path(Path(output_dir).resolve()))} if spec else {}


def _first_to_fire(spec: str) -> bool:
    """True when this process may fire: no marker is configured, or it is the first to create it."""
    marker = os.environ.get(ONCE_ENV)
    if not marker:
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(f"{spec} pid {os.getpid()} at {time.time():.3f}\n")
    return True
