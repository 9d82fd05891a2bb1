"""Task families whose row i depends only on the data seed and i, so each controller builds only the rows it owns:
`reasoning_gym:NAME` (`gym_tasks`) and `textarena:ID` (environment episodes, `gcore_rl.agents.textarena_env`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gcore_rl.data.gym_tasks import gym_task_rows
from gcore_rl.errors import ConfigError, DataError

FAMILIES = ("reasoning_gym:", "textarena:")


def is_indexed_task(name: str | None) -> bool:
    """True for a task name of a family above."""
    return isinstance(name, str) and name.startswith(FAMILIES)


def is_environment_task(name: str | None) -> bool:
    """True for a task whose rows open environment episodes (`textarena:ID`), played by `env_turns`."""
    return isinstance(name, str) and name.startswith("textarena:")


def indexed_task_rows(task: str, num_rows: int, seed: int, options: dict[str, Any] | None = None,
                      indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Rows `indices` (default: all `num_rows`) of `task` made with `seed` (DataError for a task or options its
    family refuses, or a missing package, naming the extra that installs it)."""
    if is_environment_task(task):
        from gcore_rl.agents.textarena_env import textarena_rows

        try:
            return textarena_rows(task.removeprefix("textarena:"), num_rows, seed, options, indices)
        except ConfigError as exc:
            raise DataError(exc.message) from None
    return gym_task_rows(task, num_rows, seed, options, indices=indices)


def check_indexed_task(task: str, options: dict[str, Any]) -> None:
    """DataError unless `task` names a task of its family that accepts `options` (building one row)."""
    indexed_task_rows(task, 1, seed=0, options=options, indices=[0])
