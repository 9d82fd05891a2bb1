"""Starting K SPMD controller processes on this machine and waiting for them, for any controller program.

`spawn_controllers(entry, args, world, ...)` runs ``entry(rank, *args)`` in `world` spawned processes
and returns rank 0's result. A controller that raises one of our `GcoreError`s (a bad row, a damaged
model) hands it to the driver, which raises it as the one paragraph it is; any other death is a
`ProcessFailure`, and so is a hang that the `Watchdog` sees (`phase_timeout_s` > 0). Used by the
local runtime (`runtime/local.py`) for jobs of every policy kind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from gcore_rl.distributed import end_process, exit_without_teardown
from gcore_rl.errors import GcoreError, ProcessFailure
from gcore_rl.faults import job_env as fault_env
from gcore_rl.oom import killed_by
from gcore_rl.runtime.healing import Watchdog


def spawn_controllers(entry: Callable[..., Any], args: tuple, world: int, output_dir: str,
                      phase_timeout_s: float = 0.0) -> Any:
    """Run ``entry(rank, *args)`` for rank 0..world-1 in spawned processes; rank 0's return value."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    watchdog = Watchdog(output_dir, phase_timeout_s) if phase_timeout_s > 0 else None
    context = mp.start_processes(_child, args=(entry, args, output_dir, queue), nprocs=world, join=False,
                                 start_method="spawn")
    # SIGTERM to the driver alone (`kill PID`) reaches every controller, which stop at a step boundary, saved
    # (controller/preemption.py); the driver itself waits for them
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    forward = signal.signal(signal.SIGTERM, lambda *_: _signal_all(context.processes, signal.SIGTERM)) if main else None
    try:
        while not context.join(timeout=watchdog.poll_s if watchdog else None):
            if watchdog is not None:
                watchdog.check()
    except mp.ProcessRaisedException as exc:
        raise ProcessFailure(f"a controller process failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        reported = queue.get() if not queue.empty() else None
        if isinstance(reported, GcoreError):
            raise reported from None  # a user-facing error of a controller, shown as the one paragraph it is
        signum = -exc.exit_code if exc.exit_code is not None and exc.exit_code < 0 else None
        raise ProcessFailure(f"a controller process exited unexpectedly (it died: {exc}).{killed_by(signum)}") from None
    except ProcessFailure:  # a hang: the stacks are written, stop the controllers
        for process in context.processes:
            process.kill()
            process.join()
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, forward)
    return queue.get()


def _signal_all(processes, signum: int) -> None:
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)


def _child(rank: int, entry: Callable[..., Any], args: tuple, output_dir: str, queue) -> None:
    """One controller process. It ends by `end_process` (flush, `os._exit`) once its result (or its
    user-facing error) is in `queue`, without the interpreter's and the process group's teardown (gloo's
    sometimes aborted a finished run: `exit_without_teardown`); the entry has closed its own files, loggers
    and workers by then.
    Any other exception goes through torch's spawn wrapper, which records its traceback."""
    os.environ.update(fault_env(output_dir))  # an injected fault fires once per job
    exit_without_teardown()
    try:
        result = entry(rank, *args)
    except GcoreError as exc:
        queue.put(exc)  # the driver shows it; the non-zero exit makes it stop the other controllers
        end_process(1)
    if rank == 0:
        queue.put(result)
    end_process(0)
