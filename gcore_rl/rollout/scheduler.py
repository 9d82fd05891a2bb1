"""Decisions of the engine's continuous-batching loop, as pure functions.

A *sample* is one requested completion, `(prompt_index, sample_index)`; the engine keeps them in
a FIFO queue and admits them into free slots of its KV pool between decode steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def admission_size(free_slots: int, waiting: int, live: int, min_admit: int) -> int:
    """How many waiting samples to prefill before the next decode step (0 = keep decoding).

    An empty batch admits at once; otherwise admission waits until at least `min_admit` slots are
    free (or every waiting sample fits), so that one prefill forward serves several new rows
    instead of one per finished sequence.
    """
    if waiting <= 0 or free_slots <= 0:
        return 0
    if live == 0 or free_slots >= min(min_admit, waiting):
        return min(free_slots, waiting)
    return 0


def default_min_admit(slots: int) -> int:
    """Admission batch of the default policy: an eighth of the slots (at least one)."""
    return max(1, slots // 8)


def default_finish_check_every(device: torch.device) -> int:
    """Sampling rounds between the host's reads of what the batch sampled (`GenerationEngine.finish_check_every`):
    every round on a CPU, where the device's work is the host's own and reading it costs nothing; every 8th
    on a GPU, whose forwards the host then queues ahead instead of waiting for each (at most 1 read per 8
    decode steps; a finished row decodes at most 7 unkept tokens before it leaves)."""
    return 8 if device.type == "cuda" else 1


def share_prefill(prompt_of_sample: Sequence[int]) -> tuple[list[int], list[int]]:
    """Group admitted samples by prompt so that each distinct prompt is prefilled once.

    Args: `prompt_of_sample[j]` = prompt index of the j-th admitted sample.
    Returns `(prompts, source)`: the distinct prompt indices in first-seen order, and for each
    sample the position in `prompts` of its prompt (whose prefilled row it copies).
    """
    position: dict[int, int] = {}
    source = [position.setdefault(p, len(position)) for p in prompt_of_sample]
    return list(position), source


def prefill_chunks(width: int, chunk_tokens: int, first_col: int = 0) -> list[tuple[int, int]]:
    """Column ranges `[first, end)` that prefill columns `first_col .. width-1` of a batch (the earlier ones
    hold cached keys) in forwards of at most `chunk_tokens` columns each, in order (0 = one forward)."""
    span = width - first_col
    step = chunk_tokens if 0 < chunk_tokens < span else span
    return [(first, min(first + step, width)) for first in range(first_col, width, step)]
