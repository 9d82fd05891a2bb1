"""Scripted players: they play an environment's episodes to write warm-start traces for supervised fine-tuning
(`data.task_options.play` of a `textarena:ID` task names one by import path). A player is
`play(messages, rng) -> str`: the conversation so far (the episode's messages and the player's earlier moves as
assistant turns) and a `random.Random` of the episode, to the text of its next move."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

_RANGE = re.compile(r"between (\d+) and (\d+)")
_MOVE = re.compile(r"\[(\d+)\]")
_HINT = re.compile(r"target number is (higher|lower)")


def guess_randomly(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: a number of the game's range it has not guessed yet, drawn uniformly, hints ignored (what a
    policy should learn to improve on: the hints halve the range)."""
    low, high = map(int, _RANGE.search(messages[0]["content"]).groups())
    left = [k for k in range(low, high + 1) if k not in _guessed(messages)] or [low]
    return f"[{rng.choice(left)}]"


def guess_within_hints(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: a number drawn uniformly from those the game's hints so far still allow (above every guess
    answered "higher", below every guess answered "lower")."""
    low, high = hint_range(messages)
    return f"[{rng.randint(low, high)}]"


def guess_half_within_hints(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: each move, a coin flip between `guess_within_hints` and `guess_randomly`."""
    return guess_within_hints(messages, rng) if rng.random() < 0.5 else guess_randomly(messages, rng)


def bisect(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: the middle of the numbers the hints still allow (binary search: 1..2^k - 1 in k guesses)."""
    low, high = hint_range(messages)
    return f"[{(low + high) // 2}]"


def half_bisect(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: each move, a coin flip between `bisect` and `guess_randomly`."""
    return bisect(messages, rng) if rng.random() < 0.5 else guess_randomly(messages, rng)


def mostly_bisect(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: `bisect` three moves in four, else `guess_randomly`: traces in which the game's answers
    predict the next move better than in `half_bisect`'s, whose random half spreads it anyway (the figures:
    BENCHMARKS.md, "The textarena demo")."""
    return bisect(messages, rng) if rng.random() < 0.75 else guess_randomly(messages, rng)


def hint_range(messages: Sequence[dict[str, str]]) -> tuple[int, int]:
    """The numbers (low, high) that the game's range and its answers to the player's guesses still allow."""
    low, high = map(int, _RANGE.search(messages[0]["content"]).groups())
    guess = None
    for turn in messages[1:]:
        if turn["role"] == "assistant":
            moves = _MOVE.findall(turn["content"])
            guess = int(moves[0]) if moves else None
        elif guess is not None and (hint := _HINT.search(turn["content"])):
            low, high = (max(low, guess + 1), high) if hint.group(1) == "higher" else (low, min(high, guess - 1))
    return low, max(low, high)


def _guessed(messages: Sequence[dict[str, str]]) -> set[int]:
    return {int(m) for turn in messages if turn["role"] == "assistant" for m in _MOVE.findall(turn["content"])}
