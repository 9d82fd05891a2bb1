"""Dynamic placement's finer moves in the simulator: re-splits between waves (devices between slices, a research
module of the findings, are checked in benchmarks/checks/test_slice_moves.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gcore_rl.sim import strategies, wave_split
from gcore_rl.sim.report import summary_markdown
from gcore_rl.sim.scenario import load_scenario, resolve_job
from gcore_rl.sim.simulator import simulate
from gcore_rl.sim.workload import Wave

S64 = "scenarios/gpus64_judge.yaml"


def test_the_next_wave_is_guessed_from_the_finished_one_repeated_to_its_size():
    prompt = np.array([[10, 20, 30]])
    response = np.arange(6).reshape(1, 3, 2)
    wave = Wave(prompts=3, prompt_tokens=prompt, response_tokens=response, judge_output_tokens=response + 100)
    guess = wave_split.like(wave, 5)
    assert guess.prompts == 5
    assert guess.prompt_tokens.tolist() == [[10, 20, 30, 10, 20]]
    assert guess.response_tokens[0, 3].tolist() == [0, 1] and guess.judge_output_tokens[0, 4].tolist() == [102, 103]
    assert wave_split.like(wave, 2).response_tokens.shape == (1, 2, 2)


def test_a_wave_split_moves_only_when_the_replayed_saving_beats_the_price():
    times = {3: 100.0, 4: 95.0, 5: 90.0}
    assert wave_split.choose(times, 3, move_s=5.0).split == 5
    stay = wave_split.choose(times, 3, move_s=10.0)  # saving 10 s = price: not worth it
    assert stay.split == 3 and not stay.moved and stay.move_s == 0.0 and stay.best_s == 90.0
    assert wave_split.choose({3: 90.0, 4: 90.0}, 4, move_s=0.0).split == 4  # a tie keeps the split


def run_dynamic(*overrides: str):
    return simulate(load_scenario(S64, list(overrides)), "dynamic")


def test_waves_alike_keep_one_split_and_the_same_step_times():
    """The shipped 64-GPU job: refills from the same distribution never pay a move."""
    one = run_dynamic("steps=8")
    per_wave = run_dynamic("steps=8", "placement.wave_resplit=true")
    assert [s.seconds for s in per_wave.steps] == [s.seconds for s in one.steps]
    for step in per_wave.steps:
        assert step.features["placement/wave_moves"] == 0
        assert len(step.wave_splits) == step.waves and set(step.wave_splits) == {step.rollout_devices}
    assert all(s.wave_splits == () for s in one.steps)


@pytest.mark.slow
def test_refills_of_another_kind_re_split_between_waves_and_the_moves_are_priced():
    """Refill waves with 4x longer answers on 16-GPU slices: the replayed saving beats the move."""
    extra = ("controllers=4", "workload.refill_response_scale=4", "workload.valid_fraction.start=0.2",
             "workload.valid_fraction.end=0.2", "workload.response_growth=0", "workload.dynamic_sampling.max_waves=5")
    one = run_dynamic(*extra)
    per_wave = run_dynamic(*extra, "placement.wave_resplit=true")
    job = resolve_job(load_scenario(S64, list(extra)))
    reach = job.rebalance.max_units * job.rebalance.unit
    moves = 0
    for step in per_wave.steps:
        splits = step.wave_splits
        assert len(splits) == step.waves and splits[0] == step.rollout_devices
        changes = sum(a != b for a, b in zip(splits, splits[1:], strict=False))
        assert all(abs(a - b) <= reach for a, b in zip(splits, splits[1:], strict=False))
        assert step.features["placement/wave_moves"] == changes
        assert step.features["placement/wave_move_s"] == pytest.approx(changes * strategies.wave_move_seconds(job))
        assert step.features["placement/wave_gain_s"] > step.features["placement/wave_move_s"] or changes == 0
        moves += changes
    assert moves >= 1
    assert per_wave.mean_step_seconds <= one.mean_step_seconds
    assert f"re-split between waves in {sum(len(set(s.wave_splits)) > 1 for s in per_wave.steps)} step(s)" \
        in summary_markdown([per_wave])
    assert "re-split between waves" not in summary_markdown([one])
