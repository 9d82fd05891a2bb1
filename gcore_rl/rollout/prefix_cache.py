"""Keys and values of finished sequences, kept so that a continuation prefills only what follows them.

A multi-turn rollout continues each trajectory after the environment's or the tool's answer
(`RolloutEngine.continue_stream`): the engine reads `prefix + appended`, where `prefix` is a sequence it
has just generated. Without a cache every turn prefills the whole context again (on the textarena demo a
hundred times the positions it generates: BENCHMARKS.md, "The prefix cache"). With
`engine.prefix_cache_tokens` set, the builtin engine keeps the keys/values of each finished text sequence
here (its prompt and every generated token but the last, which was sampled and never run through the
model), least recently used first out beyond the budget; an admission whose every prompt extends a kept
entry copies those columns into the KV pool and runs the model on the rest only. The keys of a prefix do not depend on what follows it, so the tokens and
log-probs are those of a full prefill, to round-off (the kept keys come from one-token decode forwards).

The cache holds keys of one policy: the engine empties it when weights are loaded and when it sleeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedPrefix:
    """The keys and values of `tokens`, per layer `[kv_heads, len(tokens), head_dim]`."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """Least-recently-used store of `CachedPrefix` entries holding at most `max_tokens` positions in all."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"a prefix cache needs a budget of at least 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self.held_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: CachedPrefix) -> None:
        """Keep `entry` (the most recent), evicting the least recently used beyond the budget; an entry
        longer than the whole budget is not kept."""
        if len(entry.tokens) > self.max_tokens or not entry.tokens:
            return
        if entry.tokens in self._entries:
            self._drop(entry.tokens)
        self._entries[entry.tokens] = entry
        self.held_tokens += len(entry.tokens)
        while self.held_tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def longest(self, ids: Sequence[int]) -> CachedPrefix | None:
        """The longest entry whose tokens begin `ids` and leave at least one token of it to compute (the model
        must run on the last one to give the next token's logits); it becomes the most recent."""
        ids = tuple(ids)
        best = None
        for tokens in self._entries:
            if len(tokens) < len(ids) and (best is None or len(tokens) > len(best)) and ids[:len(tokens)] == tokens:
                best = tokens
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def clear(self) -> None:
        self._entries.clear()
        self.held_tokens = 0

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self.held_tokens -= len(self._entries.pop(tokens).tokens)
