"""The engine's decode forward at static shapes, replayed as a CUDA graph on a GPU (issue 49).

In the eager loop a decode step's shapes change from step to step: the live batch B (rows finish and are
refilled) and the attention span (the longest row grows by one column a step). A CUDA graph replays the
kernels it recorded, so each input must keep its shape and its address. Here:

- the batch is padded to a *bucket*, the smallest power of two that holds it (at most the pool's rows);
  the padding rows are free rows of the pool, decoding a pad token at column 0 (their keys there are
  overwritten when a sequence is admitted to the row, and no live row attends to them);
- every row attends over all the pool's columns (its mask still admits only columns `start .. end`);
- the inputs (token, position, first and write column per row) live in static buffers per bucket, and the
  logits come out in one (a `Replay` per bucket, `gcore_rl/rollout/graphs.py`).

On a CPU the same static path runs without graphs (for tests: same tokens as the eager path, log-probs to
fp32 round-off). On CUDA each bucket's step is captured on its second run and replayed after.
"""

from __future__ import annotations

import torch

from gcore_rl.rollout.graphs import GraphCapture, Replay
from gcore_rl.rollout.kv_cache import SlotKVCache, cache_keyword, decode_mask


def bucket(rows: int, slots: int) -> int:
    """The padded batch of a decode step with `rows` live rows in a pool of `slots` rows: the smallest power of two
    that holds them, at most `slots`."""
    if not 1 <= rows <= slots:
        raise ValueError(f"a decode step needs 1 .. {slots} rows, got {rows}")
    return min(1 << (rows - 1).bit_length(), slots)


class StaticDecode:
    """Decode forwards of `model` over the pool `cache` at bucketed, static shapes (`graphs`: replay CUDA graphs).

    Tied to one pool: the engine makes a new one when it reallocates its pool or wakes (the weights' storage
    changes), since a graph holds the addresses it recorded. Weight updates copy into the same storage and
    need no new capture.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, pad_id: int, capture: GraphCapture):
        self.model, self.cache, self.pad_id = model, cache, pad_id
        self.capture = capture  # the engine's: one warning and one memory pool whatever the pools it makes
        self._cache_key = cache_keyword(model)
        self._buckets: dict[int, Replay] = {}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                end: torch.Tensor) -> torch.Tensor:
        """The next-token logits `[B, V]` of the live rows 0 .. B-1: their last token `tokens` `[B]` at `positions`
        `[B]`, written to column `end` `[B]`, attending to columns `start .. end` of their pool row."""
        rows = tokens.shape[0]
        replay = self._replay(bucket(rows, self.cache.slots))
        for static, live, pad in zip(replay.inputs, (tokens, positions, start, end), (self.pad_id, 0, 0, 0),
                                     strict=True):
            static[:rows].copy_(live)
            if rows < len(static):  # a full bucket launches no fill
                static[rows:].fill_(pad)
        return replay.run()[0][:rows]

    def _replay(self, size: int) -> Replay:
        if size not in self._buckets:
            inputs = [torch.zeros(size, dtype=torch.long, device=self.cache.device) for _ in range(4)]
            self._buckets[size] = Replay(self._step, inputs, self.capture)
        return self._buckets[size]

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
              end: torch.Tensor) -> tuple[torch.Tensor]:
        """One decode forward of a bucket (`[K]` inputs): the last position's logits `[K, V]`."""
        width = self.cache.capacity
        self.cache.plan_decode(end, width)
        out = self.model(input_ids=tokens[:, None], position_ids=positions[:, None],
                         attention_mask=decode_mask(start, end, width), use_cache=True, **{self._cache_key: self.cache})
        return (out.logits[:, -1],)
