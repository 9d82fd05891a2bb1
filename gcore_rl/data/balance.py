"""Splitting a step's rows over workers so each gets the same number of rows and similar cost.

A row's cost is its training FLOPs, `SequenceCost`: linear in its length for the weights, quadratic
for attention, so one 512-token row weighs more than eight 64-token rows. The split is the
cardinality-constrained longest-processing-time rule of Kellerer & Woeginger ("A tight bound for
3-partitioning", 1993; for k-partitioning it is within 4/3 − 1/(3m) of the best split's largest
part, m parts).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SequenceCost:
    """Training FLOPs of one row of `length` tokens: ``6·N·L + 6·layers·hidden·L²``.

    The first term is the weights (2N per token forward, 4N backward; Kaplan et al. 2020, "Scaling
    Laws for Neural Language Models", §2.1); the second is causal attention: per layer, the scores
    Q·Kᵀ and their weighted sum over V cost 2·L²·hidden multiply-adds each over the full square,
    half of it under the causal mask, i.e. 2·L²·hidden FLOPs forward, three times that with the
    backward. `params` is N, the weights every token passes through.
    """

    params: float
    layers: int
    hidden: int

    def __call__(self, length: float) -> float:
        return 6.0 * self.params * length + 6.0 * self.layers * self.hidden * length * length

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SequenceCost:
        """From a decoder's config.json (``text_config`` for a multimodal one): N counted as the
        attention (4·hidden², less with grouped key/value heads), the gated MLP (3·hidden·intermediate)
        per layer, and the LM head (vocab·hidden)."""
        section = config.get("text_config") or config
        layers, hidden = int(section["num_hidden_layers"]), int(section["hidden_size"])
        heads = int(section.get("num_attention_heads") or 1)
        kv_heads = int(section.get("num_key_value_heads") or heads)
        intermediate = int(section.get("intermediate_size") or 4 * hidden)
        attention = 2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads
        params = layers * (attention + 3 * hidden * intermediate) + int(section.get("vocab_size") or 0) * hidden
        return cls(params=float(params), layers=layers, hidden=hidden)


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """Largest part's cost over the mean part's (1 = perfectly balanced)."""
    totals = [sum(costs[row] for row in rows) for rows in parts]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def balance_rows(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split row indices into `parts` lists of equal length with near-equal total cost.

    Greedy longest-first (see the module docstring): rows in decreasing cost go to the part with
    the smallest total that still has room (the lowest index among equal totals). Equal row counts
    keep the workers' FSDP micro-batches paired; balanced cost (e.g. tokens) keeps them finishing
    together. Each returned list is sorted. Raises ValueError when the rows cannot be split evenly.
    The parts with room wait in a heap keyed by (total, index), so a split costs O(n log parts):
    the simulator splits tens of thousands of rows over hundreds of ranks every simulated step.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} rows cannot be split evenly over {parts} workers")
    capacity = len(costs) // parts
    open_parts = [(0.0, part) for part in range(parts)]  # (total, part) of every part with room: already a heap
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(costs)), key=lambda r: (-costs[r], r)):
        total, part = heapq.heappop(open_parts)
        assigned[part].append(row)
        if len(assigned[part]) < capacity:
            heapq.heappush(open_parts, (total + costs[row], part))
    return [sorted(rows) for rows in assigned]
