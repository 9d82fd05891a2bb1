"""Prompt rows from reasoning-gym's procedural generators (`data.task=reasoning_gym:NAME`).

reasoning-gym (`pip install 'gcore-rl[tasks]'`) holds about a hundred seeded generators (arithmetic,
algorithms, logic, games), each with its own scorer; nothing is downloaded. Item ``i`` of a dataset made
with seed ``s`` depends only on ``s`` and ``i``, so a row's global index decides it: every controller
builds only the rows it owns (`gym_task_rows(..., indices=...)`) and two shards never share one. The
held-out rows come from the data seed plus `EVAL_SEED_OFFSET`, as for the built-in tasks.

A row is ``{"prompt": question, "answer": answer, "task": "reasoning_gym:NAME", "metadata": {...}}``, with
``"messages"`` (a user turn with the question, an assistant turn with the answer) instead of ``"prompt"``
when the task option ``chat`` is 1, so the tokenizer's chat template renders it. `metadata` is the
generator's own, which its scorer reads (`gcore_rl.rewards.ecosystem.reasoning_gym_score`).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence
from typing import Any

from gcore_rl.errors import DataError

PREFIX = "reasoning_gym:"
EXTRA = "pip install 'gcore-rl[tasks]'"


def is_gym_task(name: str | None) -> bool:
    """True for a task name of the form ``reasoning_gym:NAME``."""
    return isinstance(name, str) and name.startswith(PREFIX)


def gym_name(task: str) -> str:
    """``reasoning_gym:NAME`` → ``NAME``."""
    return task[len(PREFIX):]


def import_gym() -> Any:
    """The `reasoning_gym` package, or DataError naming the extra that installs it."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as exc:
        raise DataError(f"data.task asks for a reasoning-gym task, and the reasoning-gym package is not installed "
                        f"({exc}); install the tasks extra: {EXTRA}") from exc


def available_tasks() -> list[str]:
    """The names reasoning-gym registers (after `import_gym`)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_gym_task(task: str, options: dict[str, Any]) -> None:
    """DataError unless `task` names a registered generator that accepts `options` (building one item)."""
    gym_task_rows(task, 1, seed=0, options=options, indices=[0])


def gym_task_rows(task: str, num_rows: int, seed: int, options: dict[str, Any] | None = None,
                  indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Rows `indices` (default: all `num_rows`) of reasoning-gym task `task` made with `seed`.

    `options` go to the generator's config (e.g. ``{min_terms: 2, max_terms: 2}`` for ``basic_arithmetic``),
    except ``chat`` (0 or 1, default 0), which writes each row as a conversation. Raises DataError for a
    missing package (naming the extra), an unknown generator (listing the close and the available names),
    or options the generator rejects (with its own message).
    """
    gym = import_gym()
    name = gym_name(task)
    generator_options = dict(options or {})
    chat = generator_options.pop("chat", 0)
    if chat not in (0, 1, False, True):
        raise DataError(f"task `{task}`: option chat must be 0 or 1, got {chat!r}")
    known = available_tasks()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(PREFIX + c for c in close)}? " if close else ""
        raise DataError(f"unknown reasoning-gym task `{name}`; {hint}available: {', '.join(known)}")
    try:
        dataset = gym.create_dataset(name, seed=seed, size=max(num_rows, 1), **generator_options)
        return [_row(task, dataset[i], bool(chat)) for i in (range(num_rows) if indices is None else indices)]
    except DataError:
        raise
    except Exception as exc:  # the generator's own validation: TypeError, AssertionError, ValueError...
        shown = ", ".join(f"{k}={v!r}" for k, v in generator_options.items()) or "(none)"
        raise DataError(f"reasoning-gym task `{name}` rejected its options {shown} (data.task_options): "
                        f"{type(exc).__name__}: {exc}") from exc


def _row(task: str, entry: dict[str, Any], chat: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"answer": str(entry["answer"]), "task": task, "metadata": entry.get("metadata", {})}
    if chat:
        row["messages"] = [{"role": "user", "content": entry["question"]},
                           {"role": "assistant", "content": str(entry["answer"])}]
    else:
        row["prompt"] = entry["question"]
    return row
