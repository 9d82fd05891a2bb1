"""Deterministic, resumable, sharded order over prompt rows."""

from __future__ import annotations

from typing import Any

import torch


class ShardedPromptSampler:
    """Hands out row indices of one data-parallel shard, epoch after epoch.

    Every epoch `e` uses the permutation ``torch.randperm(num_rows)`` drawn from a generator
    seeded with ``seed + e`` (or the identity order when `shuffle` is False). All shards compute the
    same permutation and shard `i` takes ``perm[i::num_shards]``, so shards are disjoint and together
    cover every row once per epoch. Shards may differ in size by one row when `num_rows` is not a
    multiple of `num_shards`.

    `next_indices(n)` continues where the previous call stopped and rolls into the next epoch when
    the current one runs out, so one batch may span two (or more) epochs. `state_dict` /
    `load_state_dict` capture the exact position so a resumed run sees the same indices as an
    uninterrupted one.
    """

    def __init__(self, num_rows: int, shard_index: int = 0, num_shards: int = 1, seed: int = 0, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"num_rows must be at least 1, got {num_rows}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards - 1}], got {shard_index}")
        if num_rows < num_shards:
            raise ValueError(
                f"{num_rows} rows cannot be split over {num_shards} shards: shard {shard_index} would get no rows"
            )
        self.num_rows = num_rows
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: list[int] = self._shard_order(0)

    @property
    def epoch(self) -> int:
        """Index of the epoch the next index is taken from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Offset within this shard's order for the current epoch of the next index."""
        return self._position

    @property
    def shard_size(self) -> int:
        """Number of rows this shard visits per epoch."""
        return len(self._order)

    def _shard_order(self, epoch: int) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            perm = list(range(self.num_rows))
        return perm[self.shard_index :: self.num_shards]

    def next_indices(self, n: int) -> list[int]:
        """Return the next `n` row indices of this shard, crossing epoch boundaries as needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._shard_order(self._epoch)
            take = min(n - len(out), len(self._order) - self._position)
            out.extend(self._order[self._position : self._position + take])
            self._position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly where this sampler stands."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`.

        Raises ValueError when the saved data size or shard layout differs from this sampler's,
        since the saved position would then refer to a different order.
        """
        for key in ("num_rows", "shard_index", "num_shards"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state does not match: saved {key}={state.get(key)!r}, current {key}={getattr(self, key)!r}"
                )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._epoch = int(state["epoch"])
        self._order = self._shard_order(self._epoch)
        position = int(state["position"])
        if not 0 <= position <= len(self._order):
            raise ValueError(f"sampler state position {position} is outside [0, {len(self._order)}]")
        self._position = position
