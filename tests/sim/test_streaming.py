"""The streaming schedule: bounded staleness, weight syncs with and without partial rollout, and what
overlapping the long tail with the next batch buys (simulated seconds: deterministic model outputs)."""

from __future__ import annotations

import pytest
from small_scenario import make_scenario

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.hardware import hardware_preset
from gcore_rl.costmodel.models import model_preset
from gcore_rl.errors import ConfigError
from gcore_rl.sim.simulator import simulate, workload_steps

RULES = ("models.judge=null", "strategies=[streaming]", "placement.train_devices=2", "steps=8",
         "workload.dynamic_sampling.enabled=false")
LONG_TAIL = ("workload.response_tokens.sigma=1.2", "workload.response_tokens.max=8192")


def stream(*overrides: str):
    return simulate(make_scenario(*RULES, *overrides), "streaming")


def steady(result):
    return result.steps[1:]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_draining_at_each_sync_bounds_staleness_by_k_and_reaches_it(k):
    result = stream(f"placement.max_staleness={k}", "placement.partial_rollout=false")
    lags = [s.features["stream/staleness_max"] for s in result.steps]
    assert max(lags) == k  # generation is fast next to training here, so it runs ahead as far as allowed
    assert all(lag <= k for lag in lags)


def test_every_sample_is_trained_exactly_once():
    scenario = make_scenario(*RULES, "placement.partial_rollout=true")
    generated = sum(w.samples for work in workload_steps(scenario) for w in work.waves) * scenario.controllers
    result = simulate(scenario, "streaming")
    assert sum(s.features["stream/batch_samples"] for s in result.steps) == generated


def test_partial_rollout_stops_paying_the_tail_at_every_sync():
    drain = stream(*LONG_TAIL, "placement.partial_rollout=false")
    partial = stream(*LONG_TAIL, "placement.partial_rollout=true")
    mean = lambda r: sum(s.seconds for s in steady(r)) / len(steady(r))  # noqa: E731
    assert mean(partial) < 0.9 * mean(drain)


def test_streaming_overlaps_the_tail_that_one_step_off_waits_for():
    scenario = make_scenario(*RULES, *LONG_TAIL, "placement.partial_rollout=true", "placement.max_staleness=1",
                             "placement.recompute_logprobs=true")
    works = workload_steps(scenario)
    one_step_off = simulate(scenario, "disaggregated", works=works)
    streaming = simulate(scenario, "streaming", works=works)
    mean = lambda r: sum(s.seconds for s in r.steps[1:]) / (len(r.steps) - 1)  # noqa: E731
    assert mean(streaming) < mean(one_step_off)


def test_train_chunks_start_training_before_the_batch_is_complete():
    whole = stream(*LONG_TAIL, "placement.max_staleness=0", "placement.partial_rollout=false")
    chunks = stream(*LONG_TAIL, "placement.max_staleness=0", "placement.partial_rollout=false",
                    "placement.train_chunks=4")
    assert chunks.steps[-1].end < whole.steps[-1].end


def test_gradient_checkpointing_prices_training_at_8n_per_token():
    model, hw = model_preset("Qwen2.5-7B"), hardware_preset("H100")
    plain = float(cost.train_seconds(1e6, model, hw, cost.CostConstants(), devices=8))
    again = float(cost.train_seconds(1e6, model, hw, cost.CostConstants(), devices=8, recompute=True))
    assert again == pytest.approx(plain * 8 / 6)


@pytest.mark.parametrize("overrides, key", [
    (("strategies=[streaming]",), "strategies"),  # the small scenario has a judge
    ((*RULES, "placement.max_staleness=-1"), "placement.max_staleness"),
    ((*RULES, "placement.train_chunks=0"), "placement.train_chunks"),
])
def test_bad_streaming_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        make_scenario(*overrides).validate()
    assert err.value.key == key
