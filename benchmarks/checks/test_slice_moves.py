"""Devices moved between slices (`simlab/slice_moves.py`, a research module of the simulator findings)."""

from __future__ import annotations

import numpy as np
import pytest
from simlab import slice_moves
from simlab.slice_moves import SliceMoveSettings, plan_move

from gcore_rl.sim.scenario import load_scenario, resolve_job
from gcore_rl.sim.simulator import workload_steps

S64 = "scenarios/gpus64_judge.yaml"


def tables(slow: float, noise: float = 0.0, steps: int = 4, seed: int = 0):
    """`steps` steps of 3 slices on 7-9 devices; slice 0 is `slow` seconds slower (each step +- noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        jitter = rng.normal(0.0, noise, 3) if noise else np.zeros(3)
        out.append([{n: 100.0 * 8 / n + jitter[k] + (slow * 8 / n if k == 0 else 0.0) for n in (7, 8, 9)}
                    for k in range(3)])
    return out


def test_a_persistently_heavier_slice_gets_a_device_when_the_saving_pays_for_the_move():
    settings = SliceMoveSettings(window=4, horizon=5)
    move = plan_move(tables(slow=20.0), [8, 8, 8], settings, move_s=11.0)
    assert move is not None and move.receiver == 0 and move.donor in (1, 2)
    # slice 0 on 9 devices: 120 * 8/9 = 106.7; the donor on 7: 114.3 -> the step goes 120 -> 114.3
    assert move.saving_s == pytest.approx(120.0 - 800 / 7) and move.bound_s == pytest.approx(move.saving_s)
    assert plan_move(tables(slow=20.0), [8, 8, 8], settings, move_s=40.0) is None  # 5.7 s x 5 steps < 40 s
    assert plan_move(tables(slow=20.0), [8, 8, 8], settings, move_s=11.0, remaining=1) is None  # no time to pay back
    assert plan_move(tables(slow=20.0, steps=3), [8, 8, 8], settings, move_s=1.0) is None  # a window not yet full


def excess_tables(excess: list[list[float]]):
    """One step per row: slice k is `excess[t][k]` seconds slower than 100 s on 8 devices, and a
    device more or less changes every slice's time by -/+ 5 s."""
    return [[{7: 105.0 + e, 8: 100.0 + e, 9: 95.0 + e} for e in row] for row in excess]


def test_a_slice_slowest_in_only_some_of_the_window_gets_no_device():
    """Slice 1 is the slowest in 3 of 4 steps, by 30 s: a device from slice 2 would have saved 5 s in
    those steps (mean 3.75 s, less one standard error 2.5 s: 12.5 s over 5 steps, more than the
    move's 11 s), but being slowest by the luck of some steps is not a heavier shard (the persistence
    rule), unless the rule is relaxed."""
    window = excess_tables([[0, 30, 0], [0, 30, 0], [30, 0, 0], [0, 30, 0]])
    assert plan_move(window, [8, 8, 8], SliceMoveSettings(), move_s=11.0) is None
    relaxed = plan_move(window, [8, 8, 8], SliceMoveSettings(persistence=0.75), move_s=11.0)
    assert relaxed is not None and relaxed.receiver == 1


def test_a_saving_the_window_noise_could_explain_buys_no_move():
    """Slice 0 is always the slowest, by 10 s in two steps and 5.5 s in two: a device would have saved
    5, 5, 0.5, 0.5 s (mean 2.75 s x 5 steps > 11 s), less one standard error (1.3 s) it does not pay;
    a saving of 5 s in every step does."""
    noisy = excess_tables([[10, 0, 0], [10, 0, 0], [5.5, 0, 0], [5.5, 0, 0]])
    assert plan_move(noisy, [8, 8, 8], SliceMoveSettings(), move_s=11.0) is None
    mean_only = plan_move(noisy, [8, 8, 8], SliceMoveSettings(), move_s=7.0)  # 1.45 s x 5 > 7 s
    assert mean_only is not None and mean_only.saving_s == pytest.approx(2.75) and mean_only.bound_s < 1.5
    steady = excess_tables([[14, 0, 0]] * 4)
    move = plan_move(steady, [8, 8, 8], SliceMoveSettings(), move_s=11.0)
    assert move is not None and move.bound_s == pytest.approx(move.saving_s) == pytest.approx(5.0)


def test_the_window_needs_two_steps_for_a_standard_error():
    with pytest.raises(ValueError, match="window >= 2"):
        SliceMoveSettings(window=1)


def test_slice_moves_never_lose_to_equal_slices_and_gain_with_a_heavier_shard():
    equal = slice_moves.run(load_scenario(S64, ["steps=12"]))
    assert all(m is None for m in equal.moves) and equal.moved_s == equal.equal_s
    heavy = slice_moves.run(load_scenario(S64, ["workload.heavy_shard_scale=2"]))
    taken = [m for m in heavy.moves if m is not None]
    assert taken and all(m.receiver == 0 for m in taken)
    assert heavy.sizes[-1][0] > 8 and sum(heavy.sizes[-1]) == 64
    assert heavy.saving < -0.01  # move costs included


@pytest.mark.parametrize("overrides", [("models.judge=null",), ("models.policy.tp=2", "models.judge.tp=2")])
def test_slice_moves_without_a_judge_and_with_engines_of_two_devices(overrides):
    scenario = load_scenario(S64, ["steps=6", "workload.heavy_shard_scale=2", *overrides])
    job = resolve_job(scenario)
    result = slice_moves.run(scenario, SliceMoveSettings(window=2, horizon=5))
    unit = job.rebalance.unit
    assert all(sum(sizes) == 64 and all(n % unit == 0 for n in sizes) for sizes in result.sizes)
    if job.judge is None:  # every device generates: 8 devices are faster than 7 for the same work
        work = next(iter(workload_steps(scenario)))
        table = slice_moves.slice_seconds(job, work, 0, [7, 8])
        assert table[8] < table[7]
