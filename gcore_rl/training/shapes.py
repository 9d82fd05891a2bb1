"""How an update splits its rows into optimiser steps and micro-batches (pure; shared with the simulator)."""

from __future__ import annotations


def mini_batch_slices(rows: int, mini_batches: int) -> list[slice]:
    """The contiguous row slices of the optimiser steps of one pass: `ceil(rows / mini_batches)` rows each."""
    per_mini = -(-rows // mini_batches)
    return [slice(start, min(start + per_mini, rows)) for start in range(0, rows, per_mini)]


def update_shape(rows: int, micro_batch_size: int, mini_batches: int, ppo_epochs: int) -> tuple[int, int]:
    """(optimiser steps, training micro-batches) of an update over `rows` rows on one trainer worker."""
    if rows <= 0:
        return 0, 0
    slices = mini_batch_slices(rows, mini_batches)
    micro = sum(-(-(s.stop - s.start) // micro_batch_size) for s in slices)
    return ppo_epochs * len(slices), ppo_epochs * micro


def forward_micro_batches(rows: int, micro_batch_size: int) -> int:
    """Micro-batches of one forward-only pass (old or reference log-probs) over `rows` rows."""
    return -(-rows // micro_batch_size) if rows > 0 else 0
