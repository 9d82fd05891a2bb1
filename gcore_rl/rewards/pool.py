"""A pool of worker processes that runs calls with a per-call time limit, killing and replacing a worker whose call overruns.

A `concurrent.futures.ProcessPoolExecutor` cannot stop a call that hangs: its worker stays busy
until the pool is torn down. `pebble.ProcessPool` (a maintained library built on
multiprocessing) gives each call a timeout, terminates the worker that exceeded it and starts a
fresh one, so one hanging call costs at most its timeout and never a step.

Workers are started from a fork server (cheap to start, and safe in a process that already runs
threads, which plain fork is not); each worker takes the parent's ``sys.path`` at pool creation, so
modules the parent can import (a user's reward file on PYTHONPATH or in the working directory)
import there too.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

__all__ = ["CallResult", "TimedPool"]


@dataclass(frozen=True)
class CallResult:
    """What one call gave: its `value`, or why it has none (`timed_out`, or `failure` describing a
    worker that died or a call that could not be sent or returned)."""

    value: Any = None
    timed_out: bool = False
    failure: str | None = None


def _take_sys_path(paths: list[str]) -> None:
    sys.path[:] = paths


class TimedPool:
    """`workers` processes running `map(function, calls)` with at most `timeout_s` seconds per call.

    The processes start on the first `map` and stop at `close` (which kills calls still running);
    use it as a context manager or call `close` on every path out. `function` must be importable
    by reference (a module-level function) and its arguments and result picklable.
    """

    def __init__(self, workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.workers = workers
        self.timeout_s = timeout_s
        self._pool: Any = None

    def _started(self) -> Any:
        if self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=self.workers, initializer=_take_sys_path, initargs=(list(sys.path),),
                                     context=multiprocessing.get_context("forkserver"))
        return self._pool

    def map(self, function: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> list[CallResult]:
        """Run ``function(*args)`` for each `args` of `calls` in the workers; results in the order of `calls`.

        Exceptions raised by `function` itself are not caught here: they are re-raised in this
        process, so `function` should catch what it wants reported as a value.
        """
        pool = self._started()
        futures = [pool.schedule(function, args=args, timeout=self.timeout_s) for args in calls]
        results: list[CallResult] = []
        try:
            for future in futures:
                results.append(_result(future))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return results

    def close(self) -> None:
        """Stop the workers (killing any call still running) and wait for them to exit; idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def __enter__(self) -> TimedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _result(future: Any) -> CallResult:
    from pebble import ProcessExpired

    try:
        return CallResult(value=future.result())
    except FutureTimeout:
        return CallResult(timed_out=True)
    except ProcessExpired as exc:
        return CallResult(failure=f"its worker process died (exit code {exc.exitcode})")
