"""Tools for the agent tests (module-level, so a pool worker imports them by path)."""

from __future__ import annotations

import time


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(a * b)


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise ValueError(f"no {x}")


def slow(x: int) -> str:
    """Takes far too long.

    Args:
        x: ignored
    """
    time.sleep(30)
    return "late"


def number(x: int) -> str:
    """Returns a number, not a string.

    Args:
        x: what it returns
    """
    return x  # type: ignore[return-value]


def undocumented(a, b):
    return str(a)
