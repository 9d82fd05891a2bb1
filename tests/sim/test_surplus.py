"""The simulator holds buffered surplus groups to the trainer's age rule (`SurplusRule`, `surplus_rule`).

With a high valid fraction and oversampling, every step makes more valid groups than it trains. An
on-policy strategy trains the surplus one update later (`dynamic_sampling.max_surplus_age` = 1), so later
steps generate less; strategies that roll out ahead (disaggregated, streaming) would train it past the
staleness bound, so it is dropped and its prompts join the next step's first wave, as `WaveSampler` does
for the trainer.
"""

from __future__ import annotations

import pytest
from small_scenario import make_scenario

from gcore_rl.sim.simulator import run_scenario, surplus_rule, workload_steps
from gcore_rl.sim.workload import SurplusRule

SURPLUS = ("steps=6", "workload.valid_fraction.start=0.9", "workload.valid_fraction.end=0.9",
           "workload.dynamic_sampling.oversampling=1.5")


def waves(works):
    return [[wave.prompts for wave in work.waves] for work in works]


def test_on_policy_strategies_train_the_surplus_one_step_later():
    works = workload_steps(make_scenario(*SURPLUS), "colocate")
    assert [w.stale_dropped for w in works] == [0] * 6
    # step 0 makes 12 prompts (10 or 11 valid for 8 trained); the buffer fills part of each next step
    assert waves(works) == [[12], [8], [10], [8], [10], [8]]
    assert all(w.trained_groups == w.valid_groups == 8 for w in works)


@pytest.mark.parametrize("strategy", ["disaggregated", "streaming"])
def test_strategies_that_roll_out_ahead_drop_the_surplus_and_generate_its_prompts_again(strategy):
    works = workload_steps(make_scenario(*SURPLUS), strategy)
    dropped = [w.stale_dropped for w in works]
    assert dropped[0] == 0 and all(d > 0 for d in dropped[1:])
    # each step generates its whole target again (the gap is 8), never less than the prompts it dropped
    assert all(len(w.waves) == 1 and w.waves[0].prompts >= max(13, w.stale_dropped) for w in works[1:])
    assert all(w.trained_groups == w.valid_groups == 8 for w in works)


def test_max_surplus_age_zero_makes_on_policy_drop_it_too():
    age0 = make_scenario(*SURPLUS, "workload.dynamic_sampling.max_surplus_age=0")
    assert waves(workload_steps(age0, "partial")) == waves(workload_steps(make_scenario(*SURPLUS), "disaggregated"))


def test_rules_per_strategy():
    scenario = make_scenario(*SURPLUS, "placement.max_staleness=2")
    assert surplus_rule(scenario, "dynamic") == SurplusRule(lag=0, max_age=1)
    assert surplus_rule(scenario, "disaggregated") == SurplusRule(lag=1, max_age=1)
    assert surplus_rule(scenario, "streaming") == SurplusRule(lag=2, max_age=2)
    assert surplus_rule(make_scenario("placement.max_staleness=0.5"), "streaming") == SurplusRule(lag=1, max_age=0.5)


def test_without_dynamic_sampling_every_strategy_sees_the_same_work():
    scenario = make_scenario(*SURPLUS, "workload.dynamic_sampling.enabled=false")
    colocate, ahead = workload_steps(scenario, "colocate"), workload_steps(scenario, "disaggregated")
    assert waves(colocate) == waves(ahead) == [[8]] * 6
    assert all((a.trained_lengths == b.trained_lengths).all() for a, b in zip(colocate, ahead, strict=True))


def test_records_count_the_dropped_groups():
    results = {r.strategy: r for r in run_scenario(make_scenario(*SURPLUS), ["colocate", "disaggregated"])}
    assert [s.features["sampling/stale_dropped"] for s in results["colocate"].steps] == [0.0] * 6
    assert [s.features["sampling/stale_dropped"] for s in results["disaggregated"].steps][1:] == [3.0] + [4.0] * 4
