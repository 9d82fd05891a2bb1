"""Training progress: a rich progress bar on a terminal, one plain line per step elsewhere."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["TrainProgress", "format_stats"]

# (metric name, label, format) shown next to the bar and in plain lines.
_SHOWN = (("reward/mean", "reward", ".3f"), ("accuracy", "acc", ".2f"), ("eval/accuracy", "eval_acc", ".3f"),
          ("sft/loss", "loss", ".4f"))


def format_stats(metrics: Mapping[str, float]) -> str:
    """``reward=0.412 acc=0.38`` from whichever of the shown metrics (`_SHOWN`) are present."""
    parts = []
    for name, label, spec in _SHOWN:
        if name in metrics and metrics[name] is not None:
            value = float(metrics[name])
            parts.append(f"{label}={value:{spec}}" if math.isfinite(value) else f"{label}={value}")
    return " ".join(parts)


class TrainProgress:
    """Progress of an RL run over `total_steps` steps.

    On a terminal (and with `enabled`), shows a live bar: description, bar, ``step i/N``, the
    latest reward and accuracy, elapsed time and ETA. With ``enabled=False`` or when output is not
    a terminal (CI logs, redirected output), prints one compact line per `update` instead, e.g.
    ``step 3/40 reward=0.412 acc=0.38 2.1s (6.4s total)``.

    With ``quiet=True`` (controllers other than the first) nothing is shown at all.

    `update(step, metrics)` takes the number of steps completed so far (1 after the first step).
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        *,
        quiet: bool = False,
        description: str = "training",
        console: Console | None = None,
    ):
        self.total_steps = int(total_steps)
        self.quiet = quiet
        self.console = console if console is not None else Console(highlight=False)
        self.interactive = bool(enabled) and not quiet and self.console.is_terminal
        self._start = time.perf_counter()
        self._last = self._start
        self._progress: Progress | None = None
        self._started = False
        if self.interactive:
            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                TextColumn("{task.fields[stats]}", markup=False),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(description, total=self.total_steps, stats="")

    def start(self) -> None:
        self._start = self._last = time.perf_counter()
        if self._progress is not None and not self._started:
            self._progress.start()
            self._started = True

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        stats = format_stats(metrics)
        now = time.perf_counter()
        step_seconds, total_seconds = now - self._last, now - self._start
        self._last = now
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            return
        if self.quiet:
            return
        line = f"step {step}/{self.total_steps}"
        if stats:
            line += f" {stats}"
        line += f" {step_seconds:.1f}s ({total_seconds:.1f}s total)"
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def log(self, message: str) -> None:
        """Print a message (above the bar when it is live)."""
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None and self._started:
            self._progress.stop()
            self._started = False

    def __enter__(self) -> TrainProgress:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
