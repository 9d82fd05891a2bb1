"""Continuous-batching decode and dynamic batching against step-by-step references."""

from __future__ import annotations

import numpy as np
import pytest

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.batching import serve_in_batches
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.decode import list_schedule, run_engines
from gcore_rl.costmodel.hardware import HARDWARE
from gcore_rl.costmodel.models import MODELS

H100 = HARDWARE["H100"]
MODEL = MODELS["Qwen2.5-7B"]
C = CostConstants()


def step_by_step(context, output, slots):
    """Reference: one engine, one Python iteration per decode step."""
    start = list_schedule(output, slots)
    stop = start + output
    elapsed, finish = 0.0, np.zeros(len(output))
    for s in range(int(stop.max())):
        active = (start <= s) & (stop > s)
        kv = (context[active] + (s - start[active])).sum()
        elapsed += float(cost.decode_step_seconds(active.sum(), kv, MODEL, H100, C))
        finish[stop == s + 1] = elapsed
    return elapsed, finish


@pytest.mark.parametrize("slots", [4, 64])
def test_engines_match_the_step_by_step_reference(slots):
    rng = np.random.default_rng(1)
    n, engines = 60, 3
    engine = np.sort(rng.integers(0, engines, n))
    context = rng.integers(10, 300, n)
    output = rng.integers(1, 200, n)
    run = run_engines(engine, context, output, engines, np.zeros(engines), MODEL, H100, C, 1, slots)
    for e in range(engines):
        members = np.flatnonzero(engine == e)
        total, finish = step_by_step(context[members], output[members], slots)
        assert run.decode_seconds[e] == pytest.approx(total, rel=1e-12)
        assert run.finish_seconds[members] == pytest.approx(finish, rel=1e-12)


def test_a_long_tail_costs_the_longest_sequence_not_the_mean():
    output = np.array([100] * 63 + [4000])
    context = np.full(64, 100)
    run = run_engines(np.zeros(64, int), context, output, 1, [6400], MODEL, H100, C, 1, 256)
    assert run.steps[0] == 4000 > output.mean()
    assert run.token_steps[0] == output.sum()
    # after step 100 a single sequence decodes: the tail runs at batch 1, paying the full weight read per token
    tail = float(cost.decode_step_seconds(1, 100 + 100, MODEL, H100, C))
    assert run.decode_seconds[0] > 3900 * tail
    # one prefill forward: its FLOPs plus a forward's fixed cost
    assert run.prefill_seconds[0] == pytest.approx(float(cost.prefill_seconds(6400, MODEL, H100, C))
                                                   + cost.step_fixed_seconds(MODEL, C))


def test_list_schedule_refills_the_first_free_row():
    assert list(list_schedule(np.array([5, 3, 4, 2]), 2)) == [0, 0, 3, 5]
    assert list(list_schedule(np.array([5, 3]), 4)) == [0, 0]


def test_requests_arriving_together_form_one_batch():
    n = 20
    run = serve_in_batches(np.zeros(n), np.zeros(n, int), np.full(n, 500), np.full(n, 50), 1, np.zeros(1),
                           MODEL, H100, C, 1, 256)
    assert len(run.batch_engine) == 1
    assert run.done_at[0] == pytest.approx(run.busy_seconds[0])


def test_streaming_requests_are_batched_as_they_arrive():
    arrival = np.array([0.0, 0.01, 0.02, 5.0, 5.01, 30.0])
    n = len(arrival)
    run = serve_in_batches(arrival, np.zeros(n, int), np.full(n, 500), np.full(n, 50), 1, np.zeros(1),
                           MODEL, H100, C, 1, 256)
    batch_time = float(run.batch_end[0] - run.batch_start[0])  # ~50 decode steps
    assert batch_time < 1.0
    # first batch takes the request at t=0 alone, the next one the two that came meanwhile, ...
    assert list(run.batch_start[:3]) == pytest.approx([0.0, batch_time, 5.0])
    assert run.done_at[0] > 30.0
    assert run.token_steps[0] == 50 * n


@pytest.mark.parametrize("slots", [3, 256])
def test_batch_decode_steps_recover_each_batch_of_the_streaming_judge(slots):
    from gcore_rl.costmodel.phases import batch_decode_steps

    rng = np.random.default_rng(3)
    n, engines = 200, 4
    arrival = np.sort(rng.exponential(2.0, n))
    engine = rng.integers(0, engines, n)
    output = rng.integers(1, 400, n)
    run = serve_in_batches(arrival, engine, np.full(n, 300), output, engines, np.zeros(engines), MODEL, H100, C, 1,
                           slots)
    steps = batch_decode_steps(run, arrival, engine, output, slots)
    assert len(steps) == len(run.batch_engine) > engines  # several batches per engine
    # per engine, the batches' steps add up to the engine's decode steps (queueing included when slots < batch)
    assert np.bincount(run.batch_engine, weights=steps, minlength=engines) == pytest.approx(run.steps)
    # without queueing a batch lasts its longest request's steps: each batch at most the longest output
    if slots == 256:
        assert steps.max() == output.max()
