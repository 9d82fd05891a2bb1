"""Continuous-batching generation on many engines at once, vectorised over all their sequences.

An engine decodes up to `slots` sequences together; a sequence leaves the batch the step it
finishes and, when more are queued, the next one takes its row (first come, first served). The
active batch therefore shrinks through the long tail of the length distribution, and each decode
step costs `cost.decode_step_seconds(active, KV tokens)`.

Between two events (a sequence joining or leaving) the active count is constant and the KV cache
grows by `active` tokens per step, so the cost of the whole stretch has a closed form
(`cost.decode_segment_seconds`). Sorting the join/leave events of all engines once and summing
per stretch prices thousands of sequences on hundreds of engines in a few numpy calls. Only
engines with more sequences than slots need a (per-engine, heap-based) schedule of start steps.

All prompts of an engine are prefilled before its first decode step (cost added up front).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec


@dataclass(frozen=True)
class DecodeRun:
    """What a set of engines did for one batch of work (arrays over engines [E] or sequences [S]).

    Attributes:
        prefill_seconds: [E] prefill time of each engine.
        decode_seconds: [E] decode time of each engine.
        finish_seconds: [S] when each sequence finished, from the engines' common start.
        steps: [E] decode steps (forwards) of each engine.
        token_steps: [E] sum over steps of the active batch (= tokens decoded).
        kv_token_steps: [E] sum over steps of the KV tokens held (what the memory term reads).
        compute_bound_steps: [E] steps where the compute term exceeded the memory term.
        prefill_tokens: [E] prompt tokens prefilled.
        idle_seconds: [E] time each engine waited with nothing to decode (multi-turn trajectories waiting for
            their answers, `gcore_rl.costmodel.agent`); None: never.
    """

    prefill_seconds: np.ndarray
    decode_seconds: np.ndarray
    finish_seconds: np.ndarray
    steps: np.ndarray
    token_steps: np.ndarray
    kv_token_steps: np.ndarray
    compute_bound_steps: np.ndarray
    prefill_tokens: np.ndarray
    idle_seconds: np.ndarray | None = None

    @property
    def engine_seconds(self) -> np.ndarray:
        """[E] busy time of each engine (prefill + decode)."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def wall_seconds(self) -> np.ndarray:
        """[E] time from each engine's start to its last sequence's end (busy time and waits)."""
        return self.engine_seconds if self.idle_seconds is None else self.engine_seconds + self.idle_seconds


def list_schedule(output: np.ndarray, slots: int) -> np.ndarray:
    """Start step of each sequence (queue order) when `slots` rows serve them first come, first served."""
    n = len(output)
    start = np.zeros(n, dtype=np.int64)
    if n <= slots:
        return start
    free_at = [int(x) for x in output[:slots]]
    heapq.heapify(free_at)
    for j in range(slots, n):
        begin = free_at[0]
        start[j] = begin
        heapq.heapreplace(free_at, begin + int(output[j]))
    return start


def start_steps(engine: np.ndarray, output: np.ndarray, engines: int, slots: int) -> np.ndarray:
    """Start steps of all sequences; sequences of an engine queue in the order given."""
    counts = np.bincount(engine, minlength=engines)
    start = np.zeros(len(engine), dtype=np.int64)
    for e in np.flatnonzero(counts > slots):
        members = np.flatnonzero(engine == e)
        start[members] = list_schedule(output[members], slots)
    return start


def run_engines(engine: np.ndarray, context: np.ndarray, output: np.ndarray, engines: int,
                prefill_tokens: np.ndarray, model: ModelSpec, hw: Hardware, c: CostConstants, tp: int,
                slots: int) -> DecodeRun:
    """Simulate `engines` engines, each decoding its sequences with continuous batching.

    Args:
        engine: [S] engine index of each sequence (0 .. engines-1); queue order is array order.
        context: [S] tokens already in each sequence's context when its decoding starts.
        output: [S] tokens each sequence decodes (>= 1).
        prefill_tokens: [E] prompt tokens each engine prefills (shared prompts counted once).
        tp: devices per engine (tensor parallel); slots: most sequences an engine decodes at once.
    """
    engine = np.asarray(engine, dtype=np.int64)
    context = np.asarray(context, dtype=np.int64)
    output = np.maximum(np.asarray(output, dtype=np.int64), 1)
    n = len(engine)
    if n == 0:
        zeros = np.zeros(engines)
        return DecodeRun(zeros, zeros, np.zeros(0), np.zeros(engines, np.int64), zeros, zeros, zeros,
                         np.asarray(prefill_tokens, dtype=np.float64))
    start = start_steps(engine, output, engines, slots)
    stop = start + output
    # join (+1) and leave (-1) events; each engine's events sum to zero, so one global cumsum
    # over events sorted by (engine, step) gives every engine's running totals
    ev_engine = np.concatenate([engine, engine])
    ev_step = np.concatenate([start, stop])
    ev_active = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    offset = context - start  # KV tokens of a sequence at step s: context + (s - start)
    ev_offset = np.concatenate([offset, -offset])
    order = np.argsort(ev_engine * (int(stop.max()) + 1) + ev_step)  # ties: zero-length stretches, any order
    ev_engine, ev_step = ev_engine[order], ev_step[order]
    active = np.cumsum(ev_active[order])
    kv_offset = np.cumsum(ev_offset[order])
    inside = ev_engine[:-1] == ev_engine[1:]
    seg_cost, seg_compute = cost.decode_segment_seconds(ev_step[:-1], ev_step[1:], active[:-1], kv_offset[:-1],
                                                        model, hw, c, tp)
    keep = inside & (ev_step[1:] > ev_step[:-1]) & (active[:-1] > 0)
    seg_cost = np.where(keep, seg_cost, 0.0)
    seg_compute = np.where(keep, seg_compute, 0.0)
    decode = np.bincount(ev_engine[:-1], weights=seg_cost, minlength=engines)
    compute_steps = np.bincount(ev_engine[:-1], weights=seg_compute, minlength=engines)
    # time at each event since the engine's start
    elapsed = np.concatenate([[0.0], np.cumsum(seg_cost)])
    first = np.searchsorted(ev_engine, ev_engine, side="left")
    at_event = elapsed - elapsed[first]
    finish = np.empty(n)
    leaving = order >= n
    finish[order[leaving] - n] = at_event[leaving]
    prefill_tokens = np.asarray(prefill_tokens, dtype=np.float64)
    # one prefill forward per engine, which pays a forward's fixed cost like a decode step
    prefill = cost.prefill_seconds(prefill_tokens, model, hw, c, tp) + (prefill_tokens > 0) * cost.step_fixed_seconds(model, c)
    finish += prefill[engine]
    steps = np.zeros(engines, dtype=np.int64)
    np.maximum.at(steps, engine, stop)
    kv_steps = output * context + output * (output - 1) // 2
    return DecodeRun(prefill_seconds=prefill, decode_seconds=decode, finish_seconds=finish, steps=steps,
                     token_steps=np.bincount(engine, weights=output, minlength=engines),
                     kv_token_steps=np.bincount(engine, weights=kv_steps, minlength=engines),
                     compute_bound_steps=compute_steps, prefill_tokens=prefill_tokens)
