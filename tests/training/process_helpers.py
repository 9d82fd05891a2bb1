"""Start N worker processes (spawn) and wait for all of them, within a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp


def run_processes(worker: Callable, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """`worker(rank, *args)` in `nprocs` spawned processes; fails the test naming `what` when they are not
    all done within `timeout_s` (a process that raised fails it with its traceback); kills leftovers."""
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} {what} processes did not finish within {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
