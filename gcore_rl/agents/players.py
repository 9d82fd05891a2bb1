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


def guess_randomly(messages: Sequence[dict[str, str]], rng: random.Random) -> str:
    """GuessTheNumber: a number of the game's range it has not guessed yet, drawn uniformly, hints ignored (what a
    policy should learn to improve on: the hints halve the range)."""
    low, high = map(int, _RANGE.search(messages[0]["content"]).groups())
    guessed = {int(m) for turn in messages if turn["role"] == "assistant" for m in _MOVE.findall(turn["content"])}
    left = [k for k in range(low, high + 1) if k not in guessed] or [low]
    return f"[{rng.choice(left)}]"
