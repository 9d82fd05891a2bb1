"""The engine's decode forward at static shapes, replayed as a CUDA graph on a GPU (issue 49).

In the eager loop a decode step's shapes change from step to step: the live batch B (rows finish and are
refilled) and the attention span (the longest row grows by one column a step). A CUDA graph replays the
kernels it recorded, so each input must keep its shape and its address. Here:

- the batch is padded to a *bucket*, the smallest power of two that holds it (at most the pool's rows);
  the padding rows are free rows of the pool, decoding a pad token at column 0 (their keys there are
  overwritten when a sequence is admitted to the row, and no live row attends to them);
- every row attends over all the pool's columns (its mask still admits only columns `start .. end`);
- the inputs (token, position, first and write column per row) live in static buffers per bucket, and the
  logits come out in one.

On a CPU the same static path runs without graphs (for tests: same tokens as the eager path, log-probs to
fp32 round-off). On CUDA the first step of each bucket runs eagerly twice (a warm-up, which also allocates
the pool's lazily created layers) and is then captured; later steps of that bucket copy their inputs into
the buffers and replay. A capture that fails (a model whose forward reads a value back to the host, which
a graph cannot record) leaves that bucket eager, with one warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from gcore_rl.rollout.kv_cache import SlotKVCache, cache_keyword, decode_mask


def bucket(rows: int, slots: int) -> int:
    """The padded batch of a decode step with `rows` live rows in a pool of `slots` rows: the smallest power of two
    that holds them, at most `slots`."""
    if not 1 <= rows <= slots:
        raise ValueError(f"a decode step needs 1 .. {slots} rows, got {rows}")
    return min(1 << (rows - 1).bit_length(), slots)


@dataclass
class _Buffers:
    """One bucket's static inputs (`[K]` each) and output (`[K, V]`), and its graph once captured."""

    tokens: torch.Tensor
    positions: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    logits: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph
    steps: int = 0  # eager steps run (the capture comes after two)


class StaticDecode:
    """Decode forwards of `model` over the pool `cache` at bucketed, static shapes (`graphs`: replay CUDA graphs).

    Tied to one pool: the engine makes a new one when it reallocates its pool or wakes (the weights' storage
    changes), since a graph holds the addresses it recorded. Weight updates copy into the same storage and
    need no new capture.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, pad_id: int, graphs: bool):
        self.model, self.cache, self.pad_id = model, cache, pad_id
        self.graphs = graphs
        self._cache_key = cache_keyword(model)
        self._buckets: dict[int, _Buffers] = {}
        self._warned = False

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                end: torch.Tensor) -> torch.Tensor:
        """The next-token logits `[B, V]` of the live rows 0 .. B-1: their last token `tokens` `[B]` at `positions`
        `[B]`, written to column `end` `[B]`, attending to columns `start .. end` of their pool row."""
        rows = tokens.shape[0]
        buf = self._buffers(bucket(rows, self.cache.slots))
        for static, live, pad in ((buf.tokens, tokens, self.pad_id), (buf.positions, positions, 0),
                                  (buf.start, start, 0), (buf.end, end, 0)):
            static[:rows].copy_(live)
            static[rows:].fill_(pad)
        if buf.graph is not None:
            buf.graph.replay()
        else:
            self._eager(buf)
            buf.steps += 1
            if self.graphs and buf.steps == 2:
                self._capture(buf)
        return buf.logits[:rows]

    def _buffers(self, size: int) -> _Buffers:
        if size not in self._buckets:
            device = self.cache.device
            self._buckets[size] = _Buffers(*(torch.zeros(size, dtype=torch.long, device=device) for _ in range(4)))
        return self._buckets[size]

    def _eager(self, buf: _Buffers) -> None:
        width = self.cache.capacity
        self.cache.plan_decode(buf.end, width)
        out = self.model(input_ids=buf.tokens[:, None], position_ids=buf.positions[:, None],
                         attention_mask=decode_mask(buf.start, buf.end, width), use_cache=True,
                         **{self._cache_key: self.cache})
        if buf.logits is None:
            buf.logits = out.logits[:, -1].clone()
        else:
            buf.logits.copy_(out.logits[:, -1])

    def _capture(self, buf: _Buffers) -> None:
        """Record this bucket's step (whose inputs are in the buffers: it runs once more, writing the same keys)."""
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            # thread_local: another thread of the process (a producer schedule's rollout beside an update, a
            # checkpoint's writer) may use CUDA while this one captures; only this thread's calls are restricted
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._eager(buf)
        except RuntimeError as error:  # e.g. a host read inside the forward: this bucket stays eager
            if not self._warned:
                warnings.warn(f"the engine's decode step could not be captured as a CUDA graph ({error}); it runs "
                              "eagerly at static shapes", stacklevel=2)
                self._warned = True
            self.graphs = False
            return
        buf.graph = graph
