"""Built-in rule rewards for the synthetic tasks (and any task with a short exact answer).

Every rule reward has the signature ``fn(prompt, completion, **row) -> float``: `row` holds the
remaining columns of the prompt row (``answer``, ``task``, ...). Functions accept and ignore extra
keyword arguments so that additional columns never break them.
"""

from __future__ import annotations

from typing import Any


def exact_match(prompt: str, completion: str, answer: str = "", **row: Any) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def digit_accuracy(prompt: str, completion: str, answer: str = "", **row: Any) -> float:
    """Partial credit: fraction of character positions where completion and answer agree.

    Both strings are stripped and compared left-aligned, position by position, over
    ``max(len(completion), len(answer))`` positions, so missing characters and extra trailing
    characters both cost credit (``"95"`` vs ``"95"`` → 1.0, ``"9"`` → 0.5, ``"957"`` → 2/3,
    ``"59"`` → 0.0). Two empty strings score 1.0.
    """
    pred, ref = completion.strip(), str(answer).strip()
    length = max(len(pred), len(ref))
    if length == 0:
        return 1.0
    return sum(p == r for p, r in zip(pred, ref, strict=False)) / length


def verdict_match(prompt: str, completion: str, verdict: str = "", **row: Any) -> float:
    """1.0 when a judge's completion starts with the expected verdict (rows of the ``judge_addition`` task).

    Only the verdict counts: ``"0 =59"`` matches verdict ``"0"`` whatever correction follows it, as
    `parse_verdict` reads only the first number.
    """
    words = completion.strip().split()
    return 1.0 if words and words[0] == str(verdict) else 0.0
