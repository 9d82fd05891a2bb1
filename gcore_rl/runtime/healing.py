"""Self-healing runs: what happens when a process of the job dies or the job stops making progress.

Which failure is healed how:

- **A device that holds no trainer shard dies in the rollout phase** (Ray, `disaggregated`: its
  rollout and reward devices): Ray restarts the actor (`max_restarts` = `run.max_restarts`), and
  the controller that owns it sets it up again, gives its engine the weights last published to it,
  and sends it again the prompts whose stream broke and the scoring batch it had not answered
  (`SliceClient`), so the step completes. Each restart is a line of
  ``OUTPUT_DIR/device_restarts.jsonl``. Under `colocate`, `partial` and `dynamic` every device
  also trains, and a trainer's death breaks the trainer group's collectives: that is the next case.
- **Any other death** (a controller, a trainer, a worker outside the rollout phase, a device with
  no restarts left), an unexpected exception in a controller or worker, or a **hang**: the runtime
  raises `ProcessFailure`; `run_job` (runtime/driver.py) then starts the whole job again with
  `run.resume=auto`, from the newest complete checkpoint (or from the start when there is none),
  up to `run.max_restarts` times, one line per restart on stdout and in
  ``OUTPUT_DIR/restarts.jsonl``. The local runtime's single controller (`runtime.controllers=1`)
  runs in the driver's own process, so its death ends the driver too: only spawned controllers
  (`runtime.controllers >= 2`) and Ray jobs can be restarted.
- **Not healed**: a `GcoreError` raised by our own checks (a bad config value, data row, reward
  function, model or checkpoint) fails the same way on every attempt, so it ends the job at once.

Hang detection (`runtime.phase_timeout_s > 0`): every device worker writes a heartbeat each time
one of its phases ends (telemetry/heartbeat.py), and every controller and device-worker process
dumps the stacks of all its threads into ``OUTPUT_DIR/stacks/<process>.txt`` on SIGUSR1
(`enable_stack_dumps`). While the driver waits for the controllers, its `Watchdog` polls the
heartbeats; when no phase has ended anywhere in the job for longer than `phase_timeout_s`, it
sends SIGUSR1 to every registered process on its node, waits for the dumps, and raises
`ProcessFailure` ("hang: ..."), after which the runtime kills the job. A hang is therefore
detected between `phase_timeout_s` and `phase_timeout_s` + `BEAT_INTERVAL_S` + the poll interval
(`Watchdog.poll_s`: a tenth of the timeout, between 0.5 and 5 s) after the last phase ended. The
watch begins when the attempt's first phase ends: the processes' start (imports, loading models,
the prompt shard and a checkpoint) is not timed, so a hang there is not detected. The timeout must
exceed the longest stretch in which no phase ends anywhere in the job: the longest single phase (a
step's training on a large batch) and the restart of a device in place (loading its models).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import IO

from gcore_rl.checkpoint.layout import checkpoint_root
from gcore_rl.checkpoint.manifest import newest_valid
from gcore_rl.config import JobConfig
from gcore_rl.errors import ProcessFailure
from gcore_rl.faults import fired_at
from gcore_rl.telemetry.heartbeat import BEAT_INTERVAL_S, read_beats

STACKS_DIR = "stacks"
RESTARTS_FILE = "restarts.jsonl"
DEVICE_RESTARTS_FILE = "device_restarts.jsonl"
STACK_WAIT_S = 5.0
"""How long the watchdog waits for the signalled processes to write their stacks."""

_stack_files: dict[str, IO[str]] = {}
"""The files faulthandler writes into, kept open for the life of the process."""


def enable_stack_dumps(output_dir: str | Path, process: str) -> None:
    """On SIGUSR1, write the stacks of all of this process's threads to ``OUTPUT_DIR/stacks/<process>.txt``
    (appended), and register the process (host, pid) in ``<process>.pid`` for the watchdog to signal."""
    folder = Path(output_dir) / STACKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    file = (folder / f"{process}.txt").open("a", encoding="utf-8")
    file.write(f"# {process}: pid {os.getpid()} on {socket.gethostname()}, registered {time.ctime()}\n")
    file.flush()
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    previous = _stack_files.pop(process, None)
    _stack_files[process] = file
    if previous is not None:
        previous.close()
    registration = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    (folder / f"{process}.pid").write_text(json.dumps(registration))


class Watchdog:
    """Detects a job that makes no progress (see the module docstring) from its heartbeats."""

    def __init__(self, output_dir: str | Path, timeout_s: float):
        """Watch the job writing `output_dir`, made before its processes start (so older beats and
        registrations, of an earlier attempt, are told apart)."""
        self.out = Path(output_dir)
        self.timeout_s = timeout_s
        self.created = time.time()

    @property
    def poll_s(self) -> float:
        """How often the driver should `check`."""
        return min(5.0, max(0.5, self.timeout_s / 10))

    def check(self) -> None:
        """Raise `ProcessFailure` after dumping every process's stacks when the job has stalled."""
        stall = self.stall()
        if stall is None:
            return
        missing = self.dump_stacks()
        if missing:
            stall += f"\nno stacks from processes on other nodes: {', '.join(missing)}"
        raise ProcessFailure(stall)

    def stall(self) -> str | None:
        """A description of the stall when no phase has ended for longer than the timeout since the
        first one did, else None."""
        now = time.time()
        beats = sorted((b for b in read_beats(self.out) if b.time >= self.created), key=lambda b: b.time)
        if not beats or now - beats[-1].time <= self.timeout_s + BEAT_INTERVAL_S:
            return None
        last = beats[-1]
        lines = [f"hang: no progress for {now - last.time:.0f} s (runtime.phase_timeout_s={self.timeout_s:g}) in step "
                 f"{last.step} after phase {last.phase} ended on {last.process}; stacks in {self.out / STACKS_DIR}"]
        lines += [f"  {b.process}: last ended {b.phase} of step {b.step}, {now - b.time:.0f} s ago" for b in reversed(beats)]
        return "\n".join(lines)

    def dump_stacks(self) -> list[str]:
        """SIGUSR1 to every process registered for this job on this node; wait for their stacks.
        Returns the processes on other nodes (not signalled)."""
        host = socket.gethostname()
        waiting, remote = {}, []
        for path in sorted((self.out / STACKS_DIR).glob("*.pid")):
            try:
                registered = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if registered["time"] < self.created:
                continue  # a process of an earlier attempt
            if registered["host"] != host:
                remote.append(path.stem)
                continue
            stacks = path.with_suffix(".txt")
            size = stacks.stat().st_size if stacks.exists() else 0
            try:
                os.kill(registered["pid"], signal.SIGUSR1)
            except ProcessLookupError:
                continue
            waiting[stacks] = size
        deadline = time.monotonic() + STACK_WAIT_S
        while waiting and time.monotonic() < deadline:
            waiting = {p: size for p, size in waiting.items() if not p.exists() or p.stat().st_size <= size}
            time.sleep(0.1)
        return remote


def restart_config(cfg: JobConfig) -> JobConfig:
    """The job to run after a `ProcessFailure`: continue from the newest complete checkpoint of this
    run (`run.resume=auto`, which starts fresh when there is none), or, when the job was started
    from another run's checkpoint (`run.resume=PATH`) and has not saved one of its own yet, from that."""
    if cfg.run.resume not in (None, "auto"):
        root = checkpoint_root(cfg.run.output_dir, cfg.run.checkpoint_dir)
        if not root.is_dir() or newest_valid(root, checksums=False)[0] is None:
            return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume="auto"))


def record_restart(output_dir: str | Path, restart: int, max_restarts: int, failure: ProcessFailure) -> None:
    """Say on stdout, and in ``OUTPUT_DIR/restarts.jsonl``, that the job restarts after `failure`: its cause,
    `time` (when the driver saw the failure) and, for an injected fault (`gcore_rl.faults`), `kill_at`."""
    cause = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
    print(f"restart {restart} of {max_restarts}: {cause}; continuing from the newest complete checkpoint", flush=True)
    record = {"restart": restart, "cause": cause, "detail": str(failure), "time": time.time()}
    killed = fired_at(output_dir)
    if killed is not None:
        record["kill_at"] = killed
    _append(Path(output_dir) / RESTARTS_FILE, record)


TRAINING_PHASE = "update/train"
"""The timeline phase whose start after a restart is "training again"."""


def record_training_again(output_dir: str | Path) -> float | None:
    """Complete the last line of ``OUTPUT_DIR/restarts.jsonl`` with when the restarted job trained again:
    `training_again_at`, the start of the first `TRAINING_PHASE` span any device recorded after the restart
    (`timeline/`), `failure_to_training_s` from the failure seen, and `kill_to_training_s` from an injected
    kill. Returns the seconds from the failure, or None when there was no restart or no training since."""
    path = Path(output_dir) / RESTARTS_FILE
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    last = json.loads(lines[-1])
    if "training_again_at" in last:
        return None
    starts = [event["start"] for timeline in sorted((Path(output_dir) / "timeline").glob("*.jsonl"))
              for event in map(json.loads, timeline.read_text(encoding="utf-8").splitlines())
              if event.get("what") == TRAINING_PHASE and event["start"] >= last["time"]]
    if not starts:
        return None
    last["training_again_at"] = min(starts)
    last["failure_to_training_s"] = round(last["training_again_at"] - last["time"], 3)
    if "kill_at" in last:
        last["kill_to_training_s"] = round(last["training_again_at"] - last["kill_at"], 3)
    lines[-1] = json.dumps(last)
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text("\n".join(lines) + "\n", encoding="utf-8")
    scratch.replace(path)
    return last["failure_to_training_s"]


def failure_key(output_dir: str | Path, failure: ProcessFailure) -> tuple[int, str]:
    """(step, cause) of a failure: the step after the last one recorded in `metrics.jsonl`, and the failure's
    first line with its numbers (pids, ranks, seconds) blanked. The same key twice in a row is a failure a
    restart repeats (the same out-of-memory kill in the same step), which `run_job` stops at."""
    records = Path(output_dir) / "metrics.jsonl"
    lines = records.read_text(encoding="utf-8").splitlines() if records.exists() else []
    step = json.loads(lines[-1])["step"] + 1 if lines else 1
    return step, re.sub(r"\d+", "N", str(failure).splitlines()[0] if str(failure) else type(failure).__name__)


def record_device_restart(output_dir: str | Path, controller: int, device: int, step: int, cause: str,
                          revive_s: float) -> None:
    """Say on stdout, and in ``OUTPUT_DIR/device_restarts.jsonl``, that a device's actor was restarted in place:
    `time` (when it was back, with its weights), `revive_s` (from its loss seen to then) and, for an injected
    fault, `kill_to_back_s`."""
    print(f"controller {controller}: device {device} restarted in place in step {step} after: {cause} "
          f"(back in {revive_s:.1f} s)", flush=True)
    record = {"controller": controller, "device": device, "step": step, "cause": cause, "time": time.time(),
              "revive_s": round(revive_s, 3)}
    killed = fired_at(output_dir)
    if killed is not None:
        record["kill_to_back_s"] = round(record["time"] - killed, 3)
    _append(Path(output_dir) / DEVICE_RESTARTS_FILE, record)


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
