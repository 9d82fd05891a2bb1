"""Engines that serve requests in dynamic batches as the requests arrive (the streaming judge).

Each engine keeps a queue of the requests routed to it. Whenever it is free (and awake) it takes
everything that has arrived so far as one batch and runs it to completion with continuous
batching (`decode.run_engines`); requests that arrive meanwhile form its next, larger batch. This
is how a judge device works under `partial`: completions stream in while the policy generates, so
the judge batches grow with the arrival rate, and the phase ends when the last completion's batch
ends.

The simulation advances all engines in lock step, one batch per engine per round, so it costs one
vectorised `run_engines` call per round (rounds = most batches any engine runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.decode import run_engines
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec


@dataclass(frozen=True)
class BatchedRun:
    """Batches the engines ran (one row per batch) and per-engine totals.

    Attributes:
        batch_engine, batch_start, batch_end: [B] engine index and absolute start / end of each batch.
        done_at: [E] when each engine finished its last batch (its ready time when it had no work).
        busy_seconds: [E] time each engine spent running batches.
        steps, token_steps, kv_token_steps, prefill_tokens: [E] work totals (see `DecodeRun`).
    """

    batch_engine: np.ndarray
    batch_start: np.ndarray
    batch_end: np.ndarray
    done_at: np.ndarray
    busy_seconds: np.ndarray
    steps: np.ndarray
    token_steps: np.ndarray
    kv_token_steps: np.ndarray
    prefill_tokens: np.ndarray


def serve_in_batches(arrival: np.ndarray, engine: np.ndarray, context: np.ndarray, output: np.ndarray,
                     engines: int, ready_at: np.ndarray, model: ModelSpec, hw: Hardware, c: CostConstants,
                     tp: int, slots: int) -> BatchedRun:
    """Serve request i (arriving at `arrival[i]` at engine `engine[i]`) in dynamic batches.

    Each request prefills `context[i]` tokens and decodes `output[i]` tokens. `ready_at` [E] is
    when each engine can start its first batch (e.g. after waking up).
    """
    order = np.lexsort((arrival, engine))
    arrival, engine = np.asarray(arrival, np.float64)[order], np.asarray(engine, np.int64)[order]
    context, output = np.asarray(context, np.int64)[order], np.asarray(output, np.int64)[order]
    counts = np.bincount(engine, minlength=engines)
    stop = np.cumsum(counts)
    head = stop - counts
    free = np.asarray(ready_at, dtype=np.float64).copy()
    span = (float(arrival.max()) if len(arrival) else 0.0) + 1.0
    keys = engine * span + arrival  # sorted: engines apart by more than any arrival time
    totals = {k: np.zeros(engines) for k in ("busy", "steps", "token_steps", "kv_token_steps", "prefill_tokens")}
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    while True:
        live = np.flatnonzero(head < stop)
        if len(live) == 0:
            break
        begin = np.maximum(free[live], arrival[head[live]])
        cut = np.searchsorted(keys, live * span + np.minimum(begin, span - 0.5), side="right")
        cut = np.minimum(np.maximum(cut, head[live] + 1), stop[live])
        sizes = cut - head[live]
        batch = np.repeat(np.arange(len(live)), sizes)
        members = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes) + np.repeat(head[live], sizes)
        run = run_engines(batch, context[members], output[members], len(live),
                          np.bincount(batch, weights=context[members], minlength=len(live)), model, hw, c, tp, slots)
        seconds = run.engine_seconds
        rows.append((live, begin, begin + seconds))
        free[live] = begin + seconds
        head[live] = cut
        totals["busy"][live] += seconds
        totals["steps"][live] += run.steps
        totals["token_steps"][live] += run.token_steps
        totals["kv_token_steps"][live] += run.kv_token_steps
        totals["prefill_tokens"][live] += run.prefill_tokens
    if rows:
        batch_engine, batch_start, batch_end = (np.concatenate(parts) for parts in zip(*rows, strict=True))
    else:
        batch_engine, batch_start, batch_end = np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    return BatchedRun(batch_engine=batch_engine, batch_start=batch_start, batch_end=batch_end, done_at=free,
                      busy_seconds=totals["busy"], steps=totals["steps"], token_steps=totals["token_steps"],
                      kv_token_steps=totals["kv_token_steps"], prefill_tokens=totals["prefill_tokens"])
