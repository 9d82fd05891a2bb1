"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", §3.4).

Two remedies for completions cut off at the length limit, whose reward says little about the
reasoning in them:

- **Soft overlong punishment** (`overlong_penalty`): a length penalty added to the reward, 0 up to
  ``max_length - buffer`` tokens, then falling linearly to ``-scale`` at ``max_length`` (DAPO's
  eq. 13 with ``L_max = max_length`` and ``L_cache = buffer``). Here the engine stops every
  completion at ``sampling.max_new_tokens``, so no completion is longer than ``max_length`` and the
  penalty never goes below ``-scale``.
- **Overlong filtering** (`truncated_keep_mask`): completions stopped by the length limit
  (``finish_reason == "length"``) are masked out of the loss; they still count in their group's
  reward statistics, so their group-mates' advantages are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(length: int, max_length: int, buffer: int, scale: float = 1.0) -> float:
    """The soft overlong punishment of a completion of `length` tokens (≤ 0).

    ``0`` when ``length <= max_length - buffer``; ``scale * ((max_length - buffer) - length) / buffer``
    inside the buffer (so ``-scale`` at ``length == max_length``); ``-scale`` beyond. ``buffer == 0``
    turns the shaping off (always 0).

    Raises:
        ValueError: ``buffer`` negative or not below ``max_length``, or ``scale`` negative.
    """
    if buffer == 0:
        return 0.0
    if not 0 < buffer < max_length:
        raise ValueError(f"the overlong buffer must be in [0, max_length={max_length}), got {buffer}")
    if scale < 0:
        raise ValueError(f"the overlong penalty scale must be >= 0, got {scale}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -scale * min(length - start, buffer) / buffer


def overlong_penalties(lengths: Sequence[int], max_length: int, buffer: int, scale: float = 1.0) -> list[float]:
    """`overlong_penalty` of each completion length, in order."""
    return [overlong_penalty(length, max_length, buffer, scale) for length in lengths]


def truncated_keep_mask(finish_reasons: Sequence[str]) -> list[float]:
    """Overlong filtering: 0.0 for each completion the length limit stopped (``"length"``), else 1.0."""
    return [0.0 if reason == "length" else 1.0 for reason in finish_reasons]
