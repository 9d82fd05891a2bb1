"""Deterministic, resumable order over the prompt rows held by one data-parallel shard.

The partition of the data into shards is fixed and lives in `gcore_rl.data.sources`
(`shard_row_indices`, `load_prompt_rows(cfg, shard_index, num_shards)`): each controller loads only
its own rows. This module only decides in which order a shard visits the rows it holds, so it works
with local positions ``0 .. num_rows - 1`` into that shard's row list.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np


class ShardedPromptSampler:
    """Hands out local positions into one shard's rows, epoch after epoch.

    `num_rows` is the number of rows THIS shard holds (``len(load_prompt_rows(cfg, i, k))``), and
    every index returned is a local position in ``[0, num_rows)``. Epoch `e` visits every position
    exactly once, in the order ``np.random.default_rng([seed mod 2**64, shard_index, e]).permutation(num_rows)``
    when `shuffle` is True, or in the identity order ``0, 1, ..., num_rows - 1`` when it is False.
    The order therefore depends only on `(seed, shard_index, e)`: different shards and different
    epochs get independent orders, and a restarted run recomputes the same ones. Pass the same
    `seed` on every shard; `shard_index` is what makes the shards' orders differ.

    `next_indices(n)` continues where the previous call stopped and rolls into the next epoch when
    the current one runs out, so one batch may span two (or more) epochs. `state_dict` /
    `load_state_dict` capture the exact position so a resumed run sees the same indices as an
    uninterrupted one. `continue_epoch` resumes the middle of an epoch whose first part another
    layout of shards drew (a run resumed on a different number of controllers).
    """

    def __init__(self, num_rows: int, *, seed: int = 0, shuffle: bool = True, shard_index: int = 0):
        if num_rows < 1:
            raise ValueError(f"num_rows must be at least 1, got {num_rows}")
        if shard_index < 0:
            raise ValueError(f"shard_index must be >= 0, got {shard_index}")
        self.num_rows = num_rows
        self.shard_index = shard_index
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._skipped: list[int] = []  # positions of the current epoch drawn before a reshard (`continue_epoch`)
        self._deferred: list[int] = []  # positions of the current epoch left for the next (`end_epoch_after`)
        self._order: list[int] = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        """Index of the epoch the next index is taken from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Offset within the current epoch's order of the next index."""
        return self._position

    def _epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch `epoch` visits the local positions."""
        if not self.shuffle:
            return list(range(self.num_rows))
        rng = np.random.default_rng([self.seed % 2**64, self.shard_index, epoch])
        return rng.permutation(self.num_rows).tolist()

    def next_indices(self, n: int) -> list[int]:
        """Return the next `n` local positions of this shard, crossing epoch boundaries as needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._skipped, self._deferred = [], []
                self._order = self._epoch_order(self._epoch)
            take = min(n - len(out), len(self._order) - self._position)
            out.extend(self._order[self._position : self._position + take])
            self._position += take
        return out

    def drawn_in_epoch(self) -> list[int]:
        """The positions the current epoch has handed out so far (with those skipped by `continue_epoch`)."""
        return self._skipped + self._order[: self._position]

    @property
    def remaining_in_epoch(self) -> int:
        """Positions the current epoch has still to hand out."""
        return len(self._order) - self._position

    def continue_epoch(self, epoch: int, drawn: Collection[int], deferred: Collection[int] = ()) -> None:
        """Go on with epoch `epoch` from a point where the positions `drawn` were already handed out
        (by another layout of shards): the rest of the epoch visits the others, in the epoch's order,
        except `deferred` ones, which wait for the next epoch; later epochs are as usual. Positions
        outside the shard are ignored."""
        taken, later = set(drawn), set(deferred)
        self._epoch = int(epoch)
        order = self._epoch_order(self._epoch)
        self._skipped = [p for p in order if p in taken]
        self._deferred = [p for p in order if p in later and p not in taken]
        self._order = [p for p in order if p not in taken and p not in later]
        self._position = 0

    def end_epoch_after(self, count: int) -> None:
        """Hand out at most `count` more positions in the current epoch; the rest wait for the next.

        Shards resumed on another layout can hold different numbers of rows the epoch has not yet
        drawn; cut to the smallest, every shard ends the epoch at the same step and none draws a row
        twice in it.
        """
        cut = self._position + max(count, 0)
        self.continue_epoch(self._epoch, self.drawn_in_epoch(), [*self._deferred, *self._order[cut:]])
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly where this sampler stands."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "skipped": list(self._skipped),
            "deferred": list(self._deferred),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shard_index": self.shard_index,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict` (seed and shuffle are taken from `state`).

        Raises ValueError when the saved shard size or shard index differs from this sampler's,
        since the saved position would then refer to a different order, or when the saved
        position lies outside the epoch.
        """
        for key in ("num_rows", "shard_index"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state does not match: saved {key}={state.get(key)!r}, current {key}={getattr(self, key)!r}"
                )
        position = int(state["position"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.continue_epoch(int(state["epoch"]), state.get("skipped", []), state.get("deferred", []))
        if not 0 <= position <= len(self._order):
            raise ValueError(f"sampler state position {position} is outside [0, {len(self._order)}]")
        self._position = position
