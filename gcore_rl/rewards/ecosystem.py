"""Rule rewards from the ecosystem: HF `math-verify` for math answers, reasoning-gym's own scorers.

Both are optional (`pip install 'gcore-rl[tasks]'`); a reward named in a recipe whose package is missing
stops the job before the first step, naming the extra (`check_installed`, called when the rules load).

`math_verify` parses the reference and the completion with math-verify (LaTeX, ``\\boxed{}``, plain
expressions; units and other text normalised away) and scores 1.0 when they are equivalent by sympy.
math-verify's own timeouts use SIGALRM, which only works in a process's main thread, and a controller
scores in threads and pool workers; they are turned off here, and the time limit is the reward pool's
(`reward.workers` with `reward.timeout_s` and `reward.on_timeout`).
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from typing import Any

from gcore_rl.configlib import check_import_path
from gcore_rl.errors import ConfigError

EXTRA = "pip install 'gcore-rl[tasks]'"
GYM_SCORER = "gcore_rl.rewards.ecosystem:reasoning_gym_score"
EXACT_MATCH = "gcore_rl.rewards.builtin:exact_match"
_PACKAGES = {"math_verify": "math-verify", "reasoning_gym_score": "reasoning-gym"}
_MODULES = {"math_verify": "math_verify", "reasoning_gym_score": "reasoning_gym"}


def check_reward_path(path: str, key: str) -> None:
    """ConfigError(key) for a reward path that is not ``module:function``, or that names a reward of this
    module whose package is not installed (naming the extra)."""
    module_name, fn_name = check_import_path(path, key)
    if module_name == __name__:
        check_installed(fn_name, key)


def check_installed(fn_name: str, key: str) -> None:
    """ConfigError(key) when the package behind this module's reward `fn_name` cannot be imported."""
    module = _MODULES.get(fn_name)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(key, f"gcore_rl.rewards.ecosystem:{fn_name} needs the {_PACKAGES[fn_name]} package, which "
                          f"is not installed ({exc}); install the tasks extra: {EXTRA}") from exc


def task_scorer(task: str | None, path: str) -> str:
    """The reward to use for `path` on `task`: a reasoning-gym task's own scorer in place of the default
    `exact_match` (the generators' answers have forms exact string equality misses), else `path`."""
    return GYM_SCORER if path == EXACT_MATCH and isinstance(task, str) and task.startswith("reasoning_gym:") else path


@cache
def _math_verify() -> Any:
    module = importlib.import_module("math_verify")
    # every call with the timeouts off logs that the caller must bound the time; the reward pool does
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return module


def _parse(text: str) -> list:
    mv = _math_verify()
    parsed = mv.parse(text, parsing_timeout=None)
    if not parsed and "$" not in text:  # bare LaTeX (``\\sqrt{8}``) is found only between math delimiters
        parsed = mv.parse(f"${text}$", parsing_timeout=None)
    return parsed


def math_verify(prompt: str, completion: str, answer: str = "", **row: Any) -> float:
    """1.0 when the completion's final answer equals the reference `answer` mathematically, else 0.0.

    ``answer`` may be plain (``1/2``), LaTeX (``\\frac{1}{2}``, with or without ``$``) or carry units
    (``5 cm``); the completion's answer is taken from its ``\\boxed{}`` if it has one, else from its
    last expression. An answer that cannot be parsed scores 0.0.
    """
    gold = _parse(str(answer))
    if not gold:
        return 0.0
    predicted = _parse(completion)
    return 1.0 if predicted and _math_verify().verify(gold, predicted, timeout_seconds=None) else 0.0


@cache
def _gym_scorer(name: str) -> Any:
    return importlib.import_module("reasoning_gym").get_score_answer_fn(name)


def reasoning_gym_score(prompt: str, completion: str, answer: str = "", task: str = "",
                        metadata: dict | None = None, **row: Any) -> float:
    """reasoning-gym's own score (0.0-1.0) of the completion for a row of `data.task=reasoning_gym:NAME`.

    The generator's scorer reads the row's reference `answer` and its `metadata`; surrounding whitespace
    of the completion is stripped first (the scorers compare strings).
    """
    if not task.startswith("reasoning_gym:"):
        raise ValueError(f"reasoning_gym_score scores rows of a reasoning_gym:NAME task, got task {task!r}")
    entry = {"question": prompt, "answer": answer, "metadata": metadata or {}}
    return float(_gym_scorer(task.split(":", 1)[1])(completion.strip(), entry))
