"""Start N worker processes (forked from the tests' preloaded forkserver) and wait for all of them, within a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp
from cli_helpers import forkserver

from gcore_rl.distributed import end_process, free_port


def run_processes(worker: Callable, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """`worker(rank, nprocs, port, *args)` in `nprocs` processes, `port` a free one for the group's rendezvous;
    fails the test naming `what` when they are not all done within `timeout_s` (a process that raised fails it
    with its traceback, one killed by a signal with that signal); kills leftovers.

    The ranks are forked from the forkserver that has imported torch, transformers and the trainer
    (`cli_helpers.forkserver`; a spawned rank spent ~3 s importing them) and import `worker`'s module as a
    spawned one would.

    A rank whose worker returned ends as a spawned controller does (`gcore_rl.distributed.end_process`:
    flush, `os._exit(0)`, no interpreter finalisation), so gloo's teardown abort at exit (SIGABRT,
    "terminate called without an active exception", BENCHMARKS.md "gloo teardown") cannot end it; any
    abort that remains fails the test."""
    forkserver()  # the process-wide server, started with the preload if no other server runs
    context = mp.start_processes(_rank, args=(worker, nprocs, free_port(), args), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} {what} processes did not finish within {timeout_s:.0f} s")
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        pytest.fail(f"{what}: rank {exc.error_index} of {nprocs} was killed by {exc.signal_name}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _rank(rank: int, worker: Callable, nprocs: int, port: int, args: tuple) -> None:
    worker(rank, nprocs, port, *args)  # an exception goes through torch's spawn wrapper, with its traceback
    end_process(0)
